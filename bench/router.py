"""`deja bench router`: routing policies compared on local replicas behind `deja route`.

    deja bench router --model demo --num-replicas 2 --num-sessions 16 --num-turns 4 \\
        --prefix-len 512 --input-len 64 --output-len 16 --max-concurrency 8
    deja bench router --overhead --model demo --history-tokens 8192   # the router's own cost

For each policy (cost, affinity, round_robin, prefix_only by default; `smg`: SMG's cache-aware
router in place of `deja route`, bench/router_smg.py; `smg_round_robin`: SMG's round robin; any
of them with `+remote`: its replicas share a remote KV tier, `--kv-remote` on a redis-server of
the run's own) the command starts fresh replicas
(`deja serve`, so every policy starts from cold caches) and a router in front of them, then runs
the same multi-turn workload of `deja bench serve` through the router: sessions share a system
prompt, turn t's prompt is the whole conversation so far. It prints the prefix-cache hit rate and
time to first token (p50/p99, all turns and turns 2+) per policy, the routing reasons the router
counted, each policy's ratios to round robin, and the oracle's hit rate (one replica with an
unlimited cache: the most any policy can reach on the workload). Replicas run one torch thread
each; with `--pin-cores 0,1` replica i runs on core i (`os.sched_setaffinity` through `taskset
-c`, the list wraps around), so replicas do not share a core with each other.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench import plots, report
from bench.router_table import compare, format_comparison, route_counts
from bench.served import add_run_flags, dataset_spec, drive, format_result
from clients.testing.cluster import (
    ProcessGroup,
    engine_busy_seconds,
    route_argv,
    scrape,
    serve_argv,
    wait_healthy,
    wait_router_replicas,
)
from clients.testing.redis_server import redis_server
from service.common.flags import add_bool_flag, add_flag
from service.common.ports import free_port
from service.router.policy import POLICIES

_POLL_INTERVAL_S = 0.5
"""`deja route --poll-interval` of the bench's routers (`--router-args` can override it)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("cluster")
    add_flag(c, "--model", default="demo", help="Model folder or 'demo' for every replica.")
    add_flag(c, "--num-replicas", type=int, default=2, help="Replicas behind the router.")
    add_flag(
        c,
        "--policies",
        default=",".join(POLICIES),
        help=f"Comma-separated policies to compare: {', '.join(POLICIES)}, smg (SMG's cache-aware "
        "router), smg_round_robin; any may end in +remote (its replicas share a remote KV tier).",
    )
    add_flag(
        c,
        "--server-args",
        default="--max-num-seqs 16",
        help="Extra `deja serve` flags for every replica.",
    )
    add_flag(c, "--router-args", default="", help="Extra `deja route` flags.")
    add_flag(
        c,
        "--pin-cores",
        default="",
        help="Comma-separated CPU ids; replica i runs pinned to the i-th (wrapping). Empty: no pinning.",
    )
    add_flag(c, "--start-timeout", type=float, default=900.0, help="Seconds to wait for startup.")
    add_flag(
        c,
        "--logs-dir",
        help="Keep every process's log here (one folder per policy and round); default: a "
        "temporary folder, removed at the end.",
    )
    w = parser.add_argument_group("workload (multi-turn, as `deja bench serve`)")
    add_flag(w, "--num-sessions", type=int, default=16, help="Conversations.")
    add_flag(w, "--num-turns", type=int, default=4, help="Turns per conversation.")
    add_flag(w, "--prefix-len", type=int, default=512, help="Shared system prompt tokens.")
    add_flag(w, "--input-len", type=int, default=64, help="User message tokens per turn.")
    add_flag(w, "--output-len", type=int, default=16, help="Generated tokens per turn.")
    add_flag(
        w,
        "--repeat",
        type=int,
        default=1,
        help="Rounds; each starts every policy's cluster afresh, policies interleaved.",
    )
    add_run_flags(w)
    add_flag(
        w,
        "--capacity-share",
        type=float,
        help="Set --request-rate to this share of round robin's closed-loop capacity here, "
        "measured first on fresh replicas with the same workload (the acceptance run's load: 0.67).",
    )
    parser.set_defaults(dataset="multi-turn")
    o = parser.add_argument_group(
        "router overhead (--overhead: no replicas, bench/router_overhead.py)"
    )
    add_bool_flag(o, "--overhead", default=False, help="Time the router's own work per request.")
    add_flag(o, "--history-tokens", type=int, default=8192, help="Chat history per request.")
    add_flag(o, "--overhead-requests", type=int, default=300, help="Requests timed.")
    add_flag(o, "--overhead-policy", default="cost", choices=POLICIES, help="Policy timed.")
    add_flag(o, "--redis-url", help="Look up in this Redis (default: the in-memory store).")
    s = parser.add_argument_group(
        "simulator check (--simulate: the run's requests replayed in `deja bench sim`'s cluster)"
    )
    add_bool_flag(
        s,
        "--simulate",
        default=False,
        help="Replay each deja policy's measured requests in the simulator (same send times, "
        "token ids and answers) and print simulated vs measured TTFT p50/p99.",
    )
    add_flag(
        s,
        "--sim-profile",
        default="calibrate",
        help="Step costs of the simulated replicas: 'calibrate' (fit them on this machine "
        "before the run, bench/sim/calibrate.py), 'cpu' (the stored fit) or a calibrate.py JSON.",
    )


@dataclasses.dataclass
class _Runs:
    """Everything one policy measured, over all rounds."""

    records: list[Any] = dataclasses.field(default_factory=list)
    duration_s: float = 0.0
    routes: dict[str, float] = dataclasses.field(default_factory=dict)
    """Requests by routing reason (warmup included)."""
    replicas: dict[str, float] = dataclasses.field(default_factory=dict)
    """Requests by replica (warmup included)."""
    model: str = ""
    oracle_cached: int = 0
    """Prompt tokens an unlimited cache would have held (`oracle_cached_tokens`), all rounds."""
    rounds: list[tuple[Any, list[Any]]] = dataclasses.field(default_factory=list)
    """(sessions, records) of each round, for --simulate."""
    busy_s: list[float] = dataclasses.field(default_factory=list)
    """Each round's engine busy seconds, all replicas (`deja_engine_busy_seconds`); deja route
    rounds only."""


@dataclasses.dataclass(frozen=True)
class _Chat:
    """With smg among the policies: every policy is sent the same chat (bench/router_smg.py)."""

    model_path: str
    tokenizer: Any
    messages_of: Any
    """bench.gateway_overhead.ChatMessages over `tokenizer`."""


async def _drive(
    target: str,
    args: argparse.Namespace,
    label: str,
    workload: Any,
    runs: _Runs,
    chat: _Chat | None,
    smg: tuple[int, str] | None = None,
) -> Any:
    """The workload through `target`, `deja route`'s deja.v1 address; or, when `smg` = (SMG's
    HTTP port, its model id) is given, through SMG (`target` is then a replica, asked for the
    model's info)."""
    from bench.workload import oracle_cached_tokens

    if smg is not None:
        from bench.router_smg import drive_smg

        assert chat is not None
        port, model = smg
        records, duration, workload, info = await drive_smg(
            port, target, args, workload, chat.messages_of, chat.tokenizer, model
        )
    else:
        messages_of = chat.messages_of if chat is not None else None
        records, duration, workload, info = await drive(
            target, args, label, workload, ready_s=60, messages_of=messages_of
        )
    runs.records += records
    runs.rounds.append((workload.sessions, records))
    runs.oracle_cached += oracle_cached_tokens(workload.sessions, records, info.block_size)
    runs.duration_s += duration
    runs.model = info.model_id
    return workload


def _run_policy(
    args: argparse.Namespace,
    policy: str,
    workload: Any,
    workdir: Path,
    runs: _Runs,
    chat: _Chat | None,
) -> Any:
    """Runs the workload through fresh replicas and a router (`deja route` or SMG); stops all."""
    from bench.router_smg import REMOTE, SMG_POLICIES, smg_argv, wait_models

    base = policy.removesuffix(REMOTE)  # with REMOTE: replicas share a tier on a redis-server
    group, stack = ProcessGroup(workdir), ExitStack()
    names = [f"r{i}" for i in range(args.num_replicas)]
    ports = {n: free_port() for n in names}
    replica_metrics = {n: free_port() for n in names}
    router_port, metrics_port = free_port(), free_port()
    try:
        shared = ["--kv-remote", stack.enter_context(redis_server())] if base != policy else []
        for n in names:
            extra = [*shlex.split(args.server_args), "--metrics-port", str(replica_metrics[n])]
            extra += shared
            argv = serve_argv(args.model, port=ports[n], replica_id=n, extra=extra)
            group.spawn(n, pinned(argv, args.pin_cores, names.index(n)))
        t0 = time.monotonic()
        if base in SMG_POLICIES:
            assert chat is not None
            for n in names:  # SMG registers only workers that answer
                wait_healthy(group, n, f"127.0.0.1:{ports[n]}", args.start_timeout)
            urls = [f"grpc://127.0.0.1:{ports[n]}" for n in names]
            smg_policy = SMG_POLICIES[base]
            argv = smg_argv(chat.model_path, router_port, metrics_port, urls, smg_policy)
            group.spawn("smg", argv)
            model = wait_models(group, "smg", router_port, args.start_timeout)
            print(f"{policy}: cluster ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
            replica = f"127.0.0.1:{ports[names[0]]}"
            smg = (router_port, model)
            return asyncio.run(_drive(replica, args, policy, workload, runs, chat, smg))
        group.spawn(
            "router",
            route_argv(
                port=router_port,
                replicas=[f"127.0.0.1:{ports[n]}" for n in names],
                policy=base,
                # NOTE: chat prompts are text: without the model's tokenizer the router has no
                # prefix chain for them and every policy routes blind.
                model=chat.model_path if chat is not None else None,
                metrics_port=metrics_port,
                extra=["--poll-interval", str(_POLL_INTERVAL_S), *shlex.split(args.router_args)],
            ),
        )
        for n in names:
            wait_healthy(group, n, f"127.0.0.1:{ports[n]}", args.start_timeout)
        wait_router_replicas(group, "router", metrics_port, len(names), args.start_timeout)
        print(f"{policy}: cluster ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        target = f"127.0.0.1:{router_port}"
        workload = asyncio.run(_drive(target, args, policy, workload, runs, chat))
        runs.busy_s.append(engine_busy_seconds(list(replica_metrics.values())))
        text = scrape(metrics_port)
        for reason, count in route_counts(text, "reason").items():
            runs.routes[reason] = runs.routes.get(reason, 0.0) + count
        for replica, count in route_counts(text, "replica").items():
            runs.replicas[replica] = runs.replicas.get(replica, 0.0) + count
        return workload
    finally:
        group.stop_all()
        stack.close()


def _chat(model: str) -> _Chat:
    from bench.gateway_overhead import ChatMessages
    from engine.demo import resolve_model_path
    from engine.worker.model_loader import load_tokenizer
    from service.common.engine_args import DEFAULT_CACHE_DIR

    path = resolve_model_path(model, Path(DEFAULT_CACHE_DIR).expanduser())
    tokenizer = load_tokenizer(path)
    return _Chat(path, tokenizer, ChatMessages(tokenizer))


def pinned(argv: list[str], cores: str, index: int) -> list[str]:
    """`argv` run on the `index`-th of the comma-separated `cores` (wrapping); unchanged if none.

    The engine core process `deja serve` spawns inherits the CPU affinity."""
    ids = [c.strip() for c in cores.split(",") if c.strip()]
    if not ids:
        return argv
    bad = [c for c in ids if not c.isdigit()]
    if bad:
        raise ValueError(f"--pin-cores takes CPU ids like 0,1; got {cores!r}")
    return ["taskset", "-c", ids[index % len(ids)], *argv]


def _simulated(
    args: argparse.Namespace, runs: dict[str, _Runs], model: Any, chat: _Chat | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """--simulate: each deja policy's rounds replayed in the simulator (bench/sim/replay.py),
    its step costs scaled so that the simulated replicas are busy as long as the real ones
    were (all deja policies' rounds together); policy -> (measured, simulated) figures, and
    the scale's figures."""
    from bench.sim import replay as sim

    poll_s, weights = sim.router_settings(args.router_args, _POLL_INTERVAL_S)
    served = sim.chat_served_ids(chat.tokenizer, chat.messages_of) if chat is not None else None
    jobs = {p: r for p, r in runs.items() if p in POLICIES}  # smg: the simulator does not run it
    replays: dict[float, dict[str, tuple[list[Any], float]]] = {}

    def replay_all(factor: float) -> dict[str, tuple[list[Any], float]]:
        if factor not in replays:
            m = sim.scaled(model, factor)
            replays[factor] = {
                p: sim.replay(
                    r.rounds,
                    model=m,
                    num_replicas=args.num_replicas,
                    policy=p,
                    poll_interval_s=poll_s,
                    weights=weights,
                    served_ids=served,
                )
                for p, r in jobs.items()
            }
        return replays[factor]

    rounds_busy = [b for r in jobs.values() for b in r.busy_s]
    # a round whose replicas could not be read: no scale (the engine-only costs)
    measured_busy = sum(rounds_busy) if all(b > 0 for b in rounds_busy) else 0.0
    factor = sim.fit_busy_scale(
        lambda f: sum(busy for _, busy in replay_all(f).values()), measured_busy
    )
    final = replay_all(factor)
    rows = {
        p: (sim.measured_figures(r.records), sim.simulated_figures(final[p][0]))
        for p, r in jobs.items()
    }
    scale = {
        "factor": factor,
        "measured_busy_s": measured_busy,
        "engine_only_busy_s": sum(busy for _, busy in replay_all(1.0).values()),
        "simulated_busy_s": sum(busy for _, busy in final.values()),
        # the engine-only calibration's TTFT p50 (x1.00), to show what the scale changed
        "engine_only_p50_s": {
            p: sim.simulated_figures(recs).p50_s for p, (recs, _) in replay_all(1.0).items()
        },
    }
    return rows, scale


def _set_rate_from_capacity(
    args: argparse.Namespace, workload: Any, tmp: Path, chat: _Chat | None, info: dict[str, Any]
) -> Any:
    """--capacity-share: round robin's closed-loop capacity (requests per second, the workload
    on fresh replicas, every request in flight as soon as the concurrency cap allows), then
    `args.request_rate` = the share of it."""
    probe = argparse.Namespace(**vars(args))
    probe.request_rate = math.inf
    measured = _Runs()
    workload = _run_policy(probe, "round_robin", workload, tmp / "capacity", measured, chat)
    ok = sum(1 for r in measured.records if r.error is None)
    capacity = ok / measured.duration_s if measured.duration_s > 0 else 0.0
    if not capacity > 0:
        raise RuntimeError("the capacity run served no request")
    args.request_rate = args.capacity_share * capacity
    info["capacity_rps"] = capacity
    print(
        f"round robin's closed-loop capacity: {capacity:.3f} requests/s ({ok} in "
        f"{measured.duration_s:.1f} s); --request-rate {args.request_rate:.3f} "
        f"({args.capacity_share:.0%} of it)",
        file=sys.stderr,
    )
    return workload


def run(args: argparse.Namespace) -> int:
    from bench.workload import summarize_by_turn

    if args.overhead:
        from bench.router_overhead import run_overhead

        return run_overhead(args)
    from bench.router_smg import REMOTE, SMG_POLICIES

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    known = (*POLICIES, *SMG_POLICIES)
    bad = [p for p in policies if p.removesuffix(REMOTE) not in known]
    if bad or not policies or args.num_replicas < 1 or args.repeat < 1:
        what = f"policies must be among {known}, each may end in {REMOTE} (a shared KV tier)"
        print(f"deja bench router: {what}", file=sys.stderr)
        return 2
    smg = any(p.removesuffix(REMOTE) in SMG_POLICIES for p in policies)
    chat = _chat(args.model) if smg else None
    if not args.request_rate > 0:
        print("deja bench router: --request-rate must be > 0 (inf: a closed loop)", file=sys.stderr)
        return 2
    if args.capacity_share is not None and not 0 < args.capacity_share <= 1:
        print("deja bench router: --capacity-share must be in (0, 1]", file=sys.stderr)
        return 2
    runs = {policy: _Runs() for policy in policies}
    info: dict[str, Any] = {
        "cpu": report.cpu_model(),
        "cores": os.cpu_count(),
        "cpu_flags": report.cpu_flags(),
        "load_avg_at_start": report.load_avg(),
        "cpu_times_at_start": report.cpu_times(),
    }
    sim_model = None
    if args.simulate:
        from bench.sim.replay import sim_model as make_sim_model

        cores = [c.strip() for c in args.pin_cores.split(",") if c.strip()]
        try:
            sim_model = make_sim_model(
                args.sim_profile, args.model, args.server_args, cores[0] if cores else None
            )
        except (OSError, KeyError, ValueError, subprocess.CalledProcessError) as e:
            why = getattr(e, "stderr", None) or e
            print(f"deja bench router: --sim-profile {args.sim_profile}: {why}", file=sys.stderr)
            return 2
        print(f"simulator cost model: {sim_model.as_dict()}", file=sys.stderr)
    workload: Any = None
    with tempfile.TemporaryDirectory(prefix="deja-bench-router-") as tmp_dir:
        tmp = args.logs_dir or tmp_dir
        try:
            if args.capacity_share is not None:
                workload = _set_rate_from_capacity(args, workload, Path(tmp), chat, info)
            # NOTE: rounds interleave the policies so that drifting background load on a shared
            # machine hits them alike.
            for round_ in range(args.repeat):
                for policy in policies:
                    workdir = Path(tmp) / f"{policy}-{round_}"
                    workload = _run_policy(args, policy, workload, workdir, runs[policy], chat)
        except (RuntimeError, TimeoutError) as e:
            print(f"deja bench router: {e}", file=sys.stderr)
            return 1
    results: dict[str, dict[str, Any]] = {}
    for policy, measured in runs.items():
        results[policy] = summarize_by_turn(measured.records, measured.duration_s)
        prompt = results[policy]["prompt_tokens"]
        results[policy].update(
            model=measured.model,
            routes=measured.routes,
            replicas=measured.replicas,
            oracle_hit_rate=measured.oracle_cached / prompt if prompt else 0.0,
        )
    out = {
        "dataset": dataclasses.asdict(dataset_spec(args)),
        "num_replicas": args.num_replicas,
        "max_concurrency": args.max_concurrency,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "repeat": args.repeat,
        "results": results,
        "comparison": compare(results),
        "machine": info,
    }
    sim_rows, scale = _simulated(args, runs, sim_model, chat) if sim_model else (None, {})
    if sim_rows is not None:
        out["simulated"] = {
            policy: {"measured": dataclasses.asdict(real), "simulated": dataclasses.asdict(sim)}
            for policy, (real, sim) in sim_rows.items()
        }
        out["simulated_busy_scale"] = scale
    end_line = f"{report.machine_line(info)}\n{report.finish_line(info)}"
    if not report.emit_report(out, args.output, args.json):
        for policy, r in results.items():
            print(format_result(policy, r))
            for key in ("routes", "replicas"):
                counts = ", ".join(f"{k} {int(v)}" for k, v in sorted(r[key].items()))
                print(f"  {key}: {counts or 'not counted (no deja route)'}")
        print(format_comparison(out["comparison"]))
        if sim_rows is not None:
            from bench.sim.replay import format_comparison as format_sim

            print(f"simulator cost model: {sim_model.source}")  # type: ignore[union-attr]
            if not scale["measured_busy_s"]:
                print("step costs not scaled: a round's replica busy time could not be read")
            print(
                f"step costs x {scale['factor']:.2f}: the replicas' engines were busy "
                f"{scale['measured_busy_s']:.1f} s (deja_engine_busy_seconds), the simulated "
                f"ones {scale['engine_only_busy_s']:.1f} s at the engine-only calibration, "
                f"{scale['simulated_busy_s']:.1f} s scaled; simulated TTFT p50 unscaled: "
                + ", ".join(f"{p} {1e3 * v:.1f} ms" for p, v in scale["engine_only_p50_s"].items())
            )
            print(format_sim(sim_rows))
        if chat is not None:
            print(
                "chat (smg among the policies): every policy got the conversation as chat text; "
                "hit rates are cached template tokens over the workload's token-id lengths, "
                "comparable between policies, not with the oracle"
            )
        print(end_line)
    if args.plot:
        plots.ttft_distributions(plots.ttfts({p: m.records for p, m in runs.items()}), args.plot)
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1
