"""Load benchmarks of served replicas (`deja bench serve`, its sweep, `deja bench router`): the
workload's flags, replicas spawned for a run, the runner against a gRPC target, one run's report.

    with spawned_variant(args, "cache-on", tmp) as target:
        result, workload = asyncio.run(bench_target(target, args, "cache-on", None))
    print(format_result("cache-on", result))
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.workload import (
    DatasetSpec,
    Progress,
    Record,
    Workload,
    run_workload,
    summarize_by_turn,
)
from clients.client import AsyncDejaClient
from clients.testing.cluster import deja_argv, serving
from service.common.flags import add_bool_flag, add_flag, to_argv
from service.common.ports import free_port

MessagesOf = Callable[[list[int]], list[dict[str, str]]]
"""Chat messages made of a workload's token-id prompt (the same messages for every path)."""

VARIANTS = {
    "cache-on": ["--prefix-caching"],
    "cache-off": ["--no-prefix-caching"],
    "remote": ["--prefix-caching"],
}
"""Replicas `deja bench serve --spawn-servers` starts: `deja serve` flags by name ("remote" also
gets `--kv-remote` of a redis-server the run starts: the remote tier written behind)."""


# -- flags -------------------------------------------------------------------------------------
def add_run_flags(group: argparse._ArgumentGroup) -> None:
    """The flags of how the workload runs (`run_measured`) and where its report goes
    (`report.emit_report`)."""
    add_flag(group, "--dataset-seed", type=int, default=0)
    add_flag(
        group, "--max-concurrency", type=int, default=8, help="Requests in flight (0: no cap)."
    )
    add_flag(
        group,
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second over all sessions (a turn still waits for its previous "
        "turn's answer); inf: a closed loop, each finished request lets the next one in.",
    )
    add_flag(group, "--warmup-requests", type=int, default=2, help="Unmeasured requests first.")
    add_bool_flag(group, "--json", default=False, help="Print JSON instead of text.")
    add_flag(group, "--output", help="Also write the JSON results to this file.")
    add_flag(
        group,
        "--plot",
        help="Also draw the results into this PNG (matplotlib): TTFT by turn per server; with "
        "--sweep-concurrency, throughput and TPOT against concurrency; `deja bench router`: "
        "TTFT distributions per policy.",
    )
    add_bool_flag(group, "--progress", default=True, help="Progress bar on stderr.")


_SPEC_FLAGS = {"name": "dataset", "seed": "dataset_seed"}
"""DatasetSpec fields whose flag has another name."""


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    """The workload a command's flags describe (--dataset, --input-len, ...); a field the
    command has no flag for keeps its default."""
    given = {}
    for f in dataclasses.fields(DatasetSpec):
        dest = _SPEC_FLAGS.get(f.name, f.name)
        if hasattr(args, dest):
            given[f.name] = getattr(args, dest)
    return DatasetSpec(**given)


# -- the runner --------------------------------------------------------------------------------
class GrpcBackend:
    """deja.v1 Generate with the prompt's token ids, or with the chat messages `messages_of`
    makes of them (the replica then applies the chat template and tokenizes)."""

    def __init__(self, client: AsyncDejaClient, messages_of: MessagesOf | None = None) -> None:
        self.client = client
        self.messages_of = messages_of

    async def stream(
        self, prompt: list[int], output_len: int, session_id: str
    ) -> AsyncIterator[tuple[list[int], int | None]]:
        given: dict[str, Any] = (
            {"prompt": prompt}
            if self.messages_of is None
            else {"messages": self.messages_of(prompt)}
        )
        async for msg in self.client.generate(
            **given,
            max_tokens=output_len,
            temperature=0.0,
            ignore_eos=True,
            return_token_ids=True,
            session_id=session_id,
        ):
            ids = [t for c in msg.choices for t in c.token_ids]
            cached = msg.final.usage.cached_prompt_tokens if msg.HasField("final") else None
            yield ids, cached


async def run_measured(
    backend: Any, workload: Workload, args: argparse.Namespace, label: str
) -> tuple[list[Record], float]:
    """The unmeasured warmup requests, then the workload at the flags' concurrency and rate;
    returns its records and wall time."""
    cap = args.max_concurrency or None
    if args.warmup_requests:
        warm = workload.warmup(args.warmup_requests, args.dataset_seed)
        await run_workload(backend, warm, max_concurrency=cap)
    progress = Progress(workload.num_requests, label, enabled=args.progress)
    return await run_workload(
        backend,
        workload.sessions,
        max_concurrency=cap,
        request_rate=args.request_rate,
        seed=args.dataset_seed,
        progress=progress,
    )


async def drive(
    target: str,
    args: argparse.Namespace,
    label: str,
    workload: Workload | None,
    *,
    token: str | None = None,
    tls: bool = False,
    ready_s: float = 30.0,
    messages_of: MessagesOf | None = None,
) -> tuple[list[Record], float, Workload, Any]:
    """`run_measured` through a gRPC client of `target`, on `workload` (None: the flags'
    dataset, built for the target's model), with token-id prompts or the chat messages
    `messages_of` makes of them. Returns the records, the wall time, the workload and the
    target's ModelInfo."""
    client = AsyncDejaClient(target, token=token, tls=tls, retries=0)
    try:
        await client.wait_ready(ready_s)
        info = await client.model_info()
        if workload is None:
            workload = Workload.build(dataset_spec(args), info.vocab_size, info.eos_token_ids)
        backend = GrpcBackend(client, messages_of)
        records, duration = await run_measured(backend, workload, args, label)
        return records, duration, workload, info
    finally:
        await client.close()


async def bench_target(
    target: str, args: argparse.Namespace, label: str, workload: Workload | None
) -> tuple[dict[str, Any], Workload]:
    """`drive`'s run summarized (all turns, turn 1, turns 2+), with the model and replica."""
    records, duration, workload, info = await drive(
        target, args, label, workload, token=args.token, tls=args.tls
    )
    result = summarize_by_turn(records, duration)
    result["model"] = info.model_id
    result["replica_id"] = info.replica_id
    return result, workload


# -- spawned replicas --------------------------------------------------------------------------
def variant_argv(args: argparse.Namespace, variant: str, port: int) -> list[str]:
    """`deja serve` with this command's engine flags; the variant sets prefix caching."""
    forwarded = [a for a in args._engine_actions if a.dest != "prefix_caching"]
    return deja_argv(
        "serve", "--host", "127.0.0.1", "--port", str(port), "--replica-id", variant,
        *to_argv(forwarded, args), *shlex.split(args.server_args), *VARIANTS[variant],
        *(["--kv-remote", args.kv_remote_url] if variant == "remote" else []),
    )  # fmt: skip


@contextmanager
def spawned_variant(args: argparse.Namespace, variant: str, tmp: Path) -> Iterator[str]:
    """`deja serve` (this command's engine flags + the variant) on a free port, healthy for the
    with-block, which gets its target; drained after it."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    argv = variant_argv(args, variant, port)
    with serving(tmp, f"serve-{variant}", argv, target, args.server_start_timeout):
        yield target


# -- one run's report --------------------------------------------------------------------------
def _row(name: str, d: dict[str, float]) -> str:
    if not d:
        return f"  {name:<10} -"
    return f"  {name:<10}" + "".join(f"{d[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99"))


def format_result(name: str, r: dict[str, Any]) -> str:
    lines = [
        f"== {name} ({r.get('model', '?')}) ==",
        f"  {r['requests'] - r['failed']}/{r['requests']} requests ok in {r['duration_s']:.1f} s: "
        f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} output tok/s, "
        f"{r['total_token_throughput']:.1f} total tok/s",
        f"  prefix-cache hit rate {100 * r['prefix_hit_rate']:.1f} % "
        f"({r['cached_prompt_tokens']}/{r['prompt_tokens']} prompt tokens)",
        f"  {'(ms)':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
        _row("TTFT", r["ttft_ms"]),
        _row("TPOT", r["tpot_ms"]),
        _row("ITL", r["itl_ms"]),
        _row("E2E", r["e2e_ms"]),
    ]
    for key, label in (("turn_1", "turn 1"), ("turns_2plus", "turns 2+")):
        if key in r:
            t = r[key]
            ttft = t["ttft_ms"]
            lines.append(
                f"  {label:<9} n={t['requests']:<4} TTFT p50 {ttft.get('p50', 0):.1f} ms, "
                f"p90 {ttft.get('p90', 0):.1f} ms, hit rate {100 * t['prefix_hit_rate']:.1f} %"
            )
    for e in r.get("errors", []):
        lines.append(f"  error: {e}")
    return "\n".join(lines)
