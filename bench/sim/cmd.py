"""`deja bench sim`: routing policies on a simulated cluster (discrete events, real policy code).

Runs every policy on every workload with the same arrivals and prints one table: TTFT p50/p99
(all turns) and turn 2+ p50, the prompt-token hit rate next to an oracle's (one unlimited cache
shared by all replicas), and load balance (busiest replica's time-averaged queued prefill tokens
over the mean, the queue integrated exactly over the run; the same for requests in flight and
busy time). `--check` also tests the bounds on the chat workloads
(cost vs round_robin: p50 <= 0.5x, p99 <= 0.8x, hit >= 90% of oracle, max/mean queued <= 1.25,
skewed p99 <= 1.5x balanced p99) and those on llm-d's shape (hit >= 90% of the oracle's,
p50 <= 0.2x round robin's, max/mean queued <= 1.3), and exits 1 when one fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace

from bench.sim.cluster import RECORDS, Cluster
from bench.sim.profile import PROFILES
from bench.sim.report import HEADER, Summary, summarise, table_rows
from bench.sim.workload import Workload, chat, llmd
from service.common.flags import add_bool_flag, add_flag
from service.router.config import add_cost_args, cost_weights_from_args
from service.router.cost import CostWeights
from service.router.policy import POLICIES

WORKLOADS = ("chat", "chat-skewed", "llm-d")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("cluster")
    add_flag(c, "--profile", default="cpu", choices=tuple(PROFILES), help="Cost model.")
    add_flag(c, "--num-replicas", type=int, default=16)
    add_flag(c, "--num-routers", type=int, default=1, help="Routers sharing one store.")
    add_flag(c, "--policies", default=",".join(POLICIES), help="Comma-separated policies.")
    add_flag(c, "--poll-interval", type=float, default=1.0, help="Router load poll (s).")
    add_flag(c, "--device-blocks", type=int, help="Override the profile's device blocks.")
    add_flag(c, "--cpu-blocks", type=int, help="Override the profile's CPU-tier blocks.")
    add_flag(
        c,
        "--records",
        default="events",
        choices=RECORDS,
        help="Prefix records from the replicas' KV events (as deja serve publishes them), or "
        "written when each request finishes (the earlier model).",
    )
    d = CostWeights()
    add_flag(
        c, "--active-weight", type=float, default=d.active_weight, help="Cost policy balance term."
    )
    add_cost_args(c)
    w = parser.add_argument_group("workload")
    add_flag(w, "--workloads", default="chat,chat-skewed", help=f"Among {','.join(WORKLOADS)}.")
    add_flag(w, "--utilisation", type=float, default=0.7, help="Of no-cache cluster capacity.")
    add_flag(w, "--num-sessions", type=int, default=1024)
    add_flag(w, "--num-turns", type=int, default=6)
    add_flag(w, "--system-len", type=int, default=1024)
    add_flag(w, "--num-variants", type=int, default=4)
    add_flag(w, "--user-len", type=int, default=128)
    add_flag(w, "--output-len", type=int, default=64)
    add_flag(w, "--think", type=float, default=5.0, help="Mean seconds between turns.")
    add_flag(w, "--skew", type=float, default=1.1, help="Zipf exponent of chat-skewed.")
    add_flag(w, "--seed", type=int, default=0)
    add_bool_flag(w, "--check", default=False, help="Test the acceptance bounds; exit 1 if not.")
    add_flag(w, "--output", help="Also write the results as JSON here.")


def _workload(name: str, args: argparse.Namespace, model: object) -> Workload:
    common = dict(model=model, num_replicas=args.num_replicas, utilisation=args.utilisation)
    if name == "llm-d":
        return llmd(**common, seed=args.seed)  # type: ignore[arg-type]
    return chat(
        **common,  # type: ignore[arg-type]
        num_sessions=args.num_sessions,
        num_turns=args.num_turns,
        system_len=args.system_len,
        num_variants=args.num_variants,
        user_len=args.user_len,
        output_len=args.output_len,
        think_s=args.think,
        skew=args.skew if name == "chat-skewed" else 0.0,
        seed=args.seed,
    )


def check(results: dict[str, list[Summary]]) -> list[str]:
    """The bounds on the chat workloads and on llm-d's shape
    (each where it was run); returns the failures."""
    fails: list[str] = []
    if "chat" not in results:
        if "llm-d" in results:
            return check_llmd(results)
        return ["--check needs the chat or llm-d workload"]

    def get(w: str, p: str) -> Summary | None:
        return next((s for s in results.get(w, []) if s.policy == p), None)

    cost, rr = get("chat", "cost"), get("chat", "round_robin")
    if cost is None or rr is None:
        return ["--check needs the chat workload and the cost and round_robin policies"]
    if cost.ttft_p50_s > 0.5 * rr.ttft_p50_s:
        fails.append(f"p50 {cost.ttft_p50_s:.3f} s > 0.5 x round robin's {rr.ttft_p50_s:.3f} s")
    if cost.ttft_p99_s > 0.8 * rr.ttft_p99_s:
        fails.append(f"p99 {cost.ttft_p99_s:.3f} s > 0.8 x round robin's {rr.ttft_p99_s:.3f} s")
    if cost.hit_vs_oracle < 0.9:
        fails.append(f"hit rate {cost.hit_vs_oracle:.1%} of the oracle's < 90%")
    if cost.max_mean_queued > 1.25:
        fails.append(f"max/mean queued {cost.max_mean_queued:.2f} > 1.25")
    skewed = get("chat-skewed", "cost")
    if skewed is not None and skewed.ttft_p99_s > 1.5 * cost.ttft_p99_s:
        fails.append(f"skewed p99 {skewed.ttft_p99_s:.3f} s > 1.5 x balanced {cost.ttft_p99_s:.3f}")
    return fails + check_llmd(results)


def check_llmd(results: dict[str, list[Summary]]) -> list[str]:
    """The bound on llm-d's shape (cost vs round_robin: hit >= 90% of the oracle's,
    p50 <= 0.2x, max/mean queued <= 1.3); nothing to check without that workload."""
    runs = {s.policy: s for s in results.get("llm-d", [])}
    cost, rr = runs.get("cost"), runs.get("round_robin")
    if cost is None or rr is None:
        return []
    fails: list[str] = []
    if cost.hit_vs_oracle < 0.9:
        fails.append(f"llm-d: hit rate {cost.hit_vs_oracle:.1%} of the oracle's < 90%")
    if cost.ttft_p50_s > 0.2 * rr.ttft_p50_s:
        fails.append(
            f"llm-d: p50 {cost.ttft_p50_s:.3f} s > 0.2 x round robin's {rr.ttft_p50_s:.3f}"
        )
    if cost.max_mean_queued > 1.3:
        fails.append(f"llm-d: max/mean queued {cost.max_mean_queued:.2f} > 1.3")
    return fails


def run(args: argparse.Namespace) -> int:
    model = PROFILES[args.profile]
    if args.device_blocks is not None:
        model = replace(model, device_blocks=args.device_blocks)
    if args.cpu_blocks is not None:
        model = replace(model, cpu_blocks=args.cpu_blocks)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if any(p not in POLICIES for p in policies) or any(w not in WORKLOADS for w in names):
        print(f"policies among {POLICIES}, workloads among {WORKLOADS}", file=sys.stderr)
        return 2
    print(f"cost model {model.name}: {json.dumps(model.as_dict())}")
    weights = cost_weights_from_args(args, active_weight=args.active_weight)
    results: dict[str, list[Summary]] = {}
    rows: list[str] = []
    for name in names:
        wl = _workload(name, args, model)
        print(f"{name}: {wl.description}", flush=True)
        for policy in policies:
            t0 = time.monotonic()
            cluster = Cluster(
                model,
                args.num_replicas,
                policy,
                num_routers=args.num_routers,
                poll_interval_s=args.poll_interval,
                weights=weights,
                seed=args.seed,
                records=args.records,
            )
            s = summarise(policy, cluster.run(wl))
            results.setdefault(name, []).append(s)
            print(f"  {policy}: {time.monotonic() - t0:.1f} s wall", file=sys.stderr, flush=True)
        rows += table_rows(name, results[name])
    print()
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for row in rows:
        print(row)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(
                {
                    "model": model.as_dict(),
                    "results": {k: [asdict(s) for s in v] for k, v in results.items()},
                },
                f,
                indent=1,
            )
    if args.check:
        fails = check(results)
        for fail in fails:
            print(f"FAIL: {fail}")
        print("acceptance: " + ("FAIL" if fails else "pass"))
        return 1 if fails else 0
    return 0
