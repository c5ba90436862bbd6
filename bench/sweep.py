"""`deja bench serve --sweep-concurrency`: served output throughput vs the offline engine, per level.

For each concurrency level c the same requests (a random / shared-prefix workload seeded with
dataset_seed + the level's index, at least c requests) run

- served: through the real gRPC client against --target or one spawned `deja serve`, at most c
  requests in flight (the `deja bench serve` runner);
- offline (--compare-offline): after the server has stopped, through `LLMEngine` in this
  process's main thread as a closed loop: c requests in flight via `add_request`, `step()` until
  one finishes, its replacement added before the next step. Same engine flags, no gRPC, no
  asyncio, no threads: the engine's own speed at that concurrency.

Output throughput = output tokens of the level's requests / wall time from the first request sent
to the last token. The table gives served, offline and their ratio (target >= 0.95 at every
level); both sides get the same warm-up requests first, unmeasured.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from bench.report import emit_report, format_load, load_avg
from bench.served import VARIANTS, bench_target, spawned_variant
from bench.workload import Record, Session, Workload, summarize

TARGET_RATIO = 0.95
SINGLE_TURN = ("random", "shared-prefix")


def parse_levels(text: str) -> list[int]:
    """'1,4,16,64' -> [1, 4, 16, 64] (each >= 1)."""
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--sweep-concurrency needs levels >= 1, got {text!r}")
    return levels


def level_args(args: argparse.Namespace, index: int, concurrency: int) -> argparse.Namespace:
    """The flags of one level: its concurrency, its own seed, at least `concurrency` requests."""
    return argparse.Namespace(
        **{
            **vars(args),
            "max_concurrency": concurrency,
            "dataset_seed": args.dataset_seed + index,
            "num_prompts": max(args.num_prompts, concurrency),
            "progress": False,
        }
    )


# -- offline -----------------------------------------------------------------------------------
def offline_closed_loop(
    engine: Any, sessions: list[Session], concurrency: int
) -> tuple[list[Record], float]:
    """Runs single-turn `sessions` on `engine` (an LLMEngine) with `concurrency` in flight.

    Returns the records (client-side figures measured at `step()` boundaries) and the wall time.
    """
    from engine.sample.sampling_params import SamplingParams

    pending = deque(enumerate(sessions))
    live: dict[str, tuple[Record, float]] = {}
    """request id -> (its record, when it was added)"""
    last_seen: dict[str, float] = {}
    records: list[Record] = []
    t_start = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i, s = pending.popleft()
            prompt = s.prefix + s.turns[0]
            params = SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True)
            req = engine.add_request(prompt, params)
            live[req.request_id] = (Record(i, 1, len(prompt)), time.perf_counter())
        for out in engine.step():
            now = time.perf_counter()
            rec, t0 = live[out.request_id]
            ids = [t for c in out.outputs for t in c.token_ids]
            if ids:
                if rec.ttft_s is None:
                    rec.ttft_s = now - t0
                else:
                    rec.itl_s.append(now - last_seen[out.request_id])
                last_seen[out.request_id] = now
                rec.output_ids.extend(ids)
            if out.finished:
                rec.cached_tokens = out.num_cached_tokens
                rec.e2e_s = now - t0
                if out.error:
                    rec.error = out.error
                records.append(rec)
                del live[out.request_id]
                last_seen.pop(out.request_id, None)
    return records, time.perf_counter() - t_start


def run_offline(
    args: argparse.Namespace, levels: list[int], workloads: dict[int, Workload]
) -> dict[int, dict[str, Any]]:
    from engine.frontend.llm_engine import LLMEngine
    from service.common.engine_args import engine_config_from_args

    engine = LLMEngine(engine_config_from_args(args))
    out: dict[int, dict[str, Any]] = {}
    try:
        for c in levels:
            w = workloads[c]
            if args.warmup_requests:
                offline_closed_loop(engine, w.warmup(args.warmup_requests, args.dataset_seed), c)
            records, duration = offline_closed_loop(engine, w.sessions, c)
            out[c] = summarize(records, duration)
    finally:
        engine.close()
    return out


# -- served ------------------------------------------------------------------------------------
def run_served(
    args: argparse.Namespace, levels: list[int], target: str
) -> tuple[dict[int, dict[str, Any]], dict[int, Workload]]:
    results: dict[int, dict[str, Any]] = {}
    workloads: dict[int, Workload] = {}
    for i, c in enumerate(levels):
        results[c], workloads[c] = asyncio.run(
            bench_target(target, level_args(args, i, c), f"c={c}", None)
        )
    return results, workloads


# -- the table ---------------------------------------------------------------------------------
def sweep_rows(
    levels: list[int], served: dict[int, dict[str, Any]], offline: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    rows = []
    for c in levels:
        s = served[c]
        row: dict[str, Any] = {
            "concurrency": c,
            "requests": s["requests"],
            "served_output_tok_s": s["output_throughput"],
            "served_ttft_p50_ms": s["ttft_ms"].get("p50"),
            "served_tpot_p50_ms": s["tpot_ms"].get("p50"),
        }
        if c in offline:
            o = offline[c]
            ratio = s["output_throughput"] / o["output_throughput"] if o["output_throughput"] else 0
            row |= {
                "offline_output_tok_s": o["output_throughput"],
                "offline_ttft_p50_ms": o["ttft_ms"].get("p50"),
                "ratio": ratio,
                "ok": ratio >= TARGET_RATIO,
            }
        rows.append(row)
    return rows


def format_sweep(rows: list[dict[str, Any]]) -> str:
    head = f"{'concurrency':>11} {'requests':>8} {'served tok/s':>12} {'offline tok/s':>13} "
    head += f"{'ratio':>6}  target >= {TARGET_RATIO}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r['concurrency']:>11} {r['requests']:>8} {r['served_output_tok_s']:>12.1f} "
        if "ratio" in r:
            verdict = "PASS" if r["ok"] else "FAIL"
            line += f"{r['offline_output_tok_s']:>13.1f} {r['ratio']:>6.3f}  {verdict}"
        else:
            line += f"{'-':>13} {'-':>6}"
        lines.append(line)
    return "\n".join(lines)


def run_sweep(args: argparse.Namespace) -> int:
    """The sweep command: served at every level, then (optionally) offline at every level."""
    try:
        levels = parse_levels(args.sweep_concurrency)
    except ValueError as e:
        print(f"deja bench serve: {e}", file=sys.stderr)
        return 2
    if args.dataset not in SINGLE_TURN:
        print(
            f"deja bench serve: --sweep-concurrency takes the {' / '.join(SINGLE_TURN)} datasets",
            file=sys.stderr,
        )
        return 2
    variants = [v.strip() for v in (args.spawn_servers or "").split(",") if v.strip()]
    if len(variants) > 1 or any(v not in VARIANTS for v in variants):
        print(
            f"deja bench serve: --sweep-concurrency takes one --spawn-servers variant of "
            f"{list(VARIANTS)}",
            file=sys.stderr,
        )
        return 2
    load_start = load_avg()
    with tempfile.TemporaryDirectory(prefix="deja-sweep-") as tmp:
        if variants:
            with spawned_variant(args, variants[0], Path(tmp)) as target:
                served, workloads = run_served(args, levels, target)
        else:
            served, workloads = run_served(args, levels, args.target)
    offline = run_offline(args, levels, workloads) if args.compare_offline else {}
    rows = sweep_rows(levels, served, offline)
    load_end = load_avg()
    report = {
        "dataset": args.dataset,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "offline": "LLMEngine closed loop in the main thread" if offline else None,
        "sweep": rows,
        "served": {str(c): r for c, r in served.items()},
        "offline_results": {str(c): r for c, r in offline.items()},
        "load_avg_start": load_start,
        "load_avg_end": load_end,
    }
    if not emit_report(report, args.output, args.json):
        print(
            f"== concurrency sweep: {args.dataset}, input {args.input_len}, output {args.output_len} =="
        )
        print(format_sweep(rows))
        print(f"load avg at start {format_load(load_start)}, at end {format_load(load_end)}")
    if args.plot:
        from bench import plots

        title = f"{args.dataset}, input {args.input_len}, output {args.output_len}"
        plots.sweep(rows, Path(args.plot), title)
    failed = sum(r["failed"] for part in (served, offline) for r in part.values())
    return 1 if failed else 0
