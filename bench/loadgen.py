"""`deja bench serve`: load-test a replica over gRPC (TTFT, TPOT, ITL, e2e, throughput, hits).

    # against a running server
    deja bench serve --target localhost:50051 --dataset random --num-prompts 64 --input-len 256

    # concurrency sweep: a spawned server vs the offline engine on the same requests, one table
    deja bench serve --spawn-servers cache-on --sweep-concurrency 1,4,16,64 --compare-offline \\
        --model demo --dataset random --num-prompts 64 --input-len 256 --output-len 32

    # multi-turn chat: 16 sessions x 4 turns sharing a 512-token system prompt, run against two
    # local servers (prefix caching on, then off) started by the command itself, plus the engine
    # in-process on the same requests (gRPC streaming overhead)
    deja bench serve --spawn-servers cache-on,cache-off --compare-in-process --model demo \\
        --dataset multi-turn --num-sessions 16 --num-turns 4 --prefix-len 512 \\
        --input-len 32 --output-len 32 --max-concurrency 4

Requests are token ids (random ordinary tokens), greedy, with ignore_eos so every answer has
--output-len tokens. Reports percentiles in ms; for multi-turn also turn 1 and turns 2+
separately. --json prints the results as JSON instead of text.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.report import emit_report, finish_line, machine_info, machine_line
from bench.served import (
    VARIANTS,
    add_run_flags,
    bench_target,
    dataset_spec,
    format_result,
    run_measured,
    spawned_variant,
)
from bench.sweep import run_sweep
from bench.workload import DATASETS, DatasetSpec, Workload, summarize_by_turn
from clients.client import add_connection_args
from clients.testing.redis_server import redis_server
from service.common.engine_args import add_engine_args
from service.common.flags import ConfigFlag, add_bool_flag, add_config_flags, add_flag

if TYPE_CHECKING:
    from engine.frontend.async_engine import AsyncEngine


_DATASET_FLAGS = (
    ConfigFlag("name", str, "What to send.", DATASETS, flag="--dataset"),
    ConfigFlag("num_prompts", int, "random / shared-prefix requests."),
    ConfigFlag(
        "input_len", int, "Prompt tokens (shared-prefix: suffix; multi-turn: user message)."
    ),
    ConfigFlag("output_len", int, "Generated tokens per request."),
    ConfigFlag("range_ratio", float, "Input length spread (0-1)."),
    ConfigFlag(
        "prefix_len", int, "Shared prefix (shared-prefix) or system prompt (multi-turn) tokens."
    ),
    ConfigFlag("num_groups", int, "shared-prefix: distinct prefixes."),
    ConfigFlag("num_sessions", int, "multi-turn: conversations."),
    ConfigFlag("num_turns", int, "multi-turn: turns per conversation."),
)
"""The DatasetSpec fields set by flags (their defaults: DatasetSpec's), in --help order."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_args(parser)
    g = parser.add_argument_group("workload")
    add_config_flags(g, DatasetSpec(), _DATASET_FLAGS)
    add_run_flags(g)
    s = parser.add_argument_group("spawned servers / in-process engine")
    add_flag(
        s,
        "--spawn-servers",
        help="Comma-separated variants to start locally and bench in turn: cache-on, cache-off, "
        "remote (cache-on plus a remote tier on a redis-server of its own). "
        "They use the engine flags below.",
    )
    add_bool_flag(
        s,
        "--compare-in-process",
        default=False,
        help="Also run the workload on the engine in this process (gRPC overhead).",
    )
    add_flag(s, "--server-args", default="", help="Extra `deja serve` flags for spawned servers.")
    add_flag(
        s,
        "--rounds",
        type=int,
        default=1,
        help="Spawned variants run in turn this many times (A B A B ...); comparisons use each "
        "variant's median over the rounds (a noisy machine drifts between runs).",
    )
    add_flag(
        s,
        "--sweep-concurrency",
        help="Comma-separated concurrency levels (e.g. 1,4,16,64): run the workload at each "
        "level against --target or the one --spawn-servers variant, print one table. Each level "
        "gets its own prompts (seed + level index: no prefix-cache hits across levels) and at "
        "least as many requests as its concurrency. random / shared-prefix datasets only.",
    )
    add_bool_flag(
        s,
        "--compare-offline",
        default=False,
        help="With --sweep-concurrency: also run every level on the offline engine, after the "
        "server has stopped, on the very same requests. Offline at concurrency c = a closed loop "
        "in this process's main thread: LLMEngine.add_request keeps c requests in flight, "
        "step() runs them, a finished request is replaced before the next step (the client's "
        "discipline, without gRPC, asyncio or threads; same engine flags as the server). "
        "Target: served output tok/s >= 0.95 x offline at every level.",
    )
    add_flag(s, "--server-start-timeout", type=float, default=900.0, help="Seconds to wait.")
    parser.set_defaults(_engine_actions=add_engine_args(parser))


# -- in process -----------------------------------------------------------------------------------


class EngineBackend:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def stream(
        self, prompt: list[int], output_len: int, session_id: str
    ) -> AsyncIterator[tuple[list[int], int | None]]:
        from engine.sample.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        async for out in self.engine.generate(prompt, params):
            ids = [t for c in out.outputs for t in c.token_ids]
            yield ids, (out.num_cached_tokens if out.finished else None)


async def _bench(
    backend: Any, workload: Workload, args: argparse.Namespace, label: str
) -> dict[str, Any]:
    return summarize_by_turn(*await run_measured(backend, workload, args, label))


def _run_spawned(
    args: argparse.Namespace, variant: str, workload: Workload | None, tmp: Path
) -> tuple[dict[str, Any], Workload]:
    with ExitStack() as stack:
        if variant == "remote":  # its shared tier: a fresh redis-server of its own
            args.kv_remote_url = stack.enter_context(redis_server())
        target = stack.enter_context(spawned_variant(args, variant, tmp))
        return asyncio.run(bench_target(target, args, variant, workload))


def _run_in_process(args: argparse.Namespace, workload: Workload | None) -> dict[str, Any]:
    from engine.frontend.async_engine import AsyncEngine
    from service.common.engine_args import engine_config_from_args

    engine = AsyncEngine.from_config(engine_config_from_args(args))
    engine.start()
    try:
        info = engine.model_info
        if workload is None:
            workload = Workload.build(dataset_spec(args), info.vocab_size, info.eos_token_ids)
        result = asyncio.run(_bench(EngineBackend(engine), workload, args, "in-process"))
        result["model"] = info.model_id
        return result
    finally:
        engine.shutdown()


# -- report ----------------------------------------------------------------------------------------


def _ttft_p50(r: dict[str, Any]) -> float | None:
    part = r.get("turns_2plus", r)
    return part["ttft_ms"].get("p50")


def _round_figures(r: dict[str, Any]) -> dict[str, float]:
    return {"tpot_p50": r["tpot_ms"].get("p50", 0.0), "output_throughput": r["output_throughput"]}


def _median_of_rounds(r: dict[str, Any], key: str) -> float:
    """The median of one figure over a variant's rounds (--rounds), or its one run's."""
    values = sorted(x[key] for x in r.get("rounds", [_round_figures(r)]))
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    on, off = results.get("cache-on"), results.get("cache-off")
    if on is not None and off is not None:
        a, b = _ttft_p50(on), _ttft_p50(off)
        key = "turns_2plus" if "turns_2plus" in on else "all"
        out["ttft_p50_ms"] = {"scope": key, "cache_on": a, "cache_off": b}
        if a and b:
            out["ttft_p50_ms"]["speedup_cache_on"] = b / a
    remote = results.get("remote")
    if on is not None and remote is not None:
        t_on, t_remote = _median_of_rounds(on, "tpot_p50"), _median_of_rounds(remote, "tpot_p50")
        x_on = _median_of_rounds(on, "output_throughput")
        x_remote = _median_of_rounds(remote, "output_throughput")
        out["remote_tier"] = {
            "rounds": len(on.get("rounds", [on])),
            "tpot_p50_ms": {"cache_on": t_on, "remote": t_remote},
            "tpot_p50_ratio": t_remote / t_on if t_on and t_remote else None,
            "output_throughput": {"cache_on": x_on, "remote": x_remote},
            "output_throughput_ratio": x_remote / x_on if x_on else None,
        }
    inproc = results.get("in-process")
    grpc_name = next((n for n in ("cache-on", "target", "cache-off") if n in results), None)
    if inproc is not None and grpc_name is not None:
        g, e = results[grpc_name]["output_throughput"], inproc["output_throughput"]
        out["grpc_overhead"] = {
            "grpc": grpc_name,
            "grpc_output_tok_s": g,
            "in_process_output_tok_s": e,
            "ratio": g / e if e else None,
        }
    return out


def format_comparison(c: dict[str, Any]) -> str:
    lines = []
    if "ttft_p50_ms" in c:
        t = c["ttft_p50_ms"]
        scope = "turns 2+" if t["scope"] == "turns_2plus" else "all requests"
        lines.append(
            f"TTFT p50 ({scope}): cache-on {t['cache_on']:.1f} ms, cache-off {t['cache_off']:.1f} "
            f"ms -> {t.get('speedup_cache_on', float('nan')):.2f}x faster with prefix caching"
        )
    if "remote_tier" in c:
        r = c["remote_tier"]
        t = r["tpot_p50_ms"]
        lines.append(
            f"remote tier written behind (median of {r['rounds']} rounds): TPOT p50 "
            f"{t['remote']:.1f} ms vs {t['cache_on']:.1f} ms without it "
            f"({r['tpot_p50_ratio']:.3f}x), output throughput {r['output_throughput_ratio']:.3f}x"
        )
    if "grpc_overhead" in c:
        o = c["grpc_overhead"]
        lines.append(
            f"gRPC streaming: {o['grpc_output_tok_s']:.1f} output tok/s through gRPC ({o['grpc']}) "
            f"vs {o['in_process_output_tok_s']:.1f} in-process (ratio {o['ratio']:.3f})"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.sweep_concurrency:
        return run_sweep(args)
    machine = machine_info(getattr(args, "threads", None))
    results: dict[str, dict[str, Any]] = {}
    workload: Workload | None = None
    variants = [v.strip() for v in (args.spawn_servers or "").split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            print(f"deja bench serve: unknown variant {v!r}; use {list(VARIANTS)}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="deja-bench-") as tmp:
        try:
            rounds: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
            for _ in range(max(1, args.rounds)):  # NOTE: interleaved, so drift hits all alike
                for v in variants:
                    results[v], workload = _run_spawned(args, v, workload, Path(tmp))
                    rounds[v].append(_round_figures(results[v]))
            for v in variants:
                results[v]["rounds"] = rounds[v]
            if not variants:
                results["target"], workload = asyncio.run(
                    bench_target(args.target, args, "target", workload)
                )
        except (RuntimeError, TimeoutError) as e:
            print(f"deja bench serve: {e}", file=sys.stderr)
            return 1
    if args.compare_in_process:
        results["in-process"] = _run_in_process(args, workload)
    finished = finish_line(machine)  # records the end's load average in `machine`
    report = {
        "machine": machine,
        "dataset": dataclasses.asdict(dataset_spec(args)),
        "max_concurrency": args.max_concurrency,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "results": results,
        "comparison": compare(results),
    }
    if not emit_report(report, args.output, args.json):
        print(machine_line(machine))
        for name, r in results.items():
            print(format_result(name, r))
        text = format_comparison(report["comparison"])
        if text:
            print("== comparison ==\n" + text)
        print(finished)
    if args.plot:
        from bench import plots

        plots.ttft_by_turn(results, Path(args.plot), f"{args.dataset}: TTFT by turn")
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1
