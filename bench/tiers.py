"""The tiered prefix cache: time to first token by tier, and multi-turn hit rates.

Part 1 (ttft): a 1,024-token prefix with a short distinct suffix, max_tokens 1, served from the
device tier, the CPU tier, the disk tier (files just written, so in the OS page cache), the
remote tier (a second engine that never saw the prefix, sharing a redis-server this command
starts; skipped without one) and recomputed (an engine with prefix caching off). The device pool holds one such prompt, so traffic
("filler" prompts of the same size) pushes the prefix down the tiers: warm -> 2 fillers (device
-> CPU -> disk) -> disk hit -> device hit -> 1 filler (device -> CPU) -> CPU hit.

Part 2 (multiturn): 32 sessions x 4 turns, each turn = the last prompt + its answer + a new user
message (after a shared system prompt), sessions round-robin in groups of 4. Three engines side by
side, each group running on all three in rotating order: device pool at 25% of the working set
with the CPU tier off, the same with the CPU tier on, and an unbounded device pool.

Part 3 (restart): bench/tiers_restart.py.

    python -m bench.tiers [--model demo] [--part all|ttft|multiturn|restart] [--json out.json]
                          [--kv-cache-dtype auto|fp8_e4m3]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from bench import common, report
from bench.tiers_restart import BS, run_restart, tier_llm
from clients.testing.redis_server import redis_server

FULL: dict[str, Any] = {
    "prefix_len": 1024,
    "suffix_len": 8,
    "reps": 3,
    "sessions": 32,
    "turns": 4,
    "system_len": 64,
    "user_len": (24, 40),
    "answer_len": 8,
    "group": 4,
}
QUICK: dict[str, Any] = {
    "prefix_len": 128,
    "suffix_len": 8,
    "reps": 1,
    "sessions": 4,
    "turns": 2,
    "system_len": 16,
    "user_len": (8, 16),
    "answer_len": 2,
    "group": 2,
}
TIERS = ("device", "cpu", "disk", "remote", "recompute")
CACHED = ("device", "cpu", "disk", "remote")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument(
        "--part",
        choices=("all", "ttft", "multiturn", "restart"),
        default="all",
        help="which part to run (restart: bench/tiers_restart.py)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8_e4m3"),
        help="KV storage of every engine and tier (default auto: the model dtype)",
    )
    parser.add_argument("--reps", type=int, default=None, help="ttft repetitions (default 2)")
    parser.add_argument("--sessions", type=int, default=None, help="multi-turn sessions (32)")
    parser.add_argument("--turns", type=int, default=None, help="turns per session (4)")
    parser.add_argument(
        "--restart-reps",
        type=int,
        default=None,
        help="restart part: restarts per mode, medians printed (default 3, 1 with --quick)",
    )
    parser.add_argument(
        "--restart-prefixes",
        type=int,
        nargs="+",
        default=None,
        help="restart part: prefix lengths in tokens (default 1024 4096; --quick: 128 256)",
    )
    parser.add_argument(
        "--device-fraction",
        type=float,
        default=0.25,
        help="multi-turn device pool as a share of the working set (0.25)",
    )


def _blocks(n_tokens: int) -> int:
    return -(-n_tokens // BS)


# -- part 1: TTFT by tier ------------------------------------------------------------------------
@dataclass(slots=True)
class TierSample:
    tier: str
    ttft: float
    cached: dict[str, int]
    """Prompt tokens served per tier (device, cpu, disk, remote)."""


def run_ttft(
    args: argparse.Namespace, model_path: str, ids: list[int], work: dict[str, Any]
) -> dict[str, Any]:
    disk_dir = tempfile.mkdtemp(prefix="deja-bench-tiers-")
    with ExitStack() as stack:
        url = stack.enter_context(redis_server()) if shutil.which("redis-server") else None
        return _run_ttft(args, model_path, ids, work, disk_dir, url)


def _run_ttft(
    args: argparse.Namespace,
    model_path: str,
    ids: list[int],
    work: dict[str, Any],
    disk_dir: str,
    url: str | None,
) -> dict[str, Any]:
    from engine import SamplingParams

    rng = random.Random(args.seed)
    plen, slen = work["prefix_len"], work["suffix_len"]
    # The device pool holds one prompt (prefix + suffix) and a spare block; a filler prompt takes
    # every block, so each filler pushes the previous contents one tier down.
    num_device = _blocks(plen + slen) + 1
    filler_len = num_device * BS
    # The CPU tier holds the prefix and one block more: one filler's spills push it to disk.
    num_cpu = plen // BS + 1
    tiered = tier_llm(
        model_path, args, num_device_blocks=num_device, num_cpu_blocks=num_cpu, disk_dir=disk_dir,
        kv_remote=url,
    )  # fmt: skip
    # another replica: it never computed the prefix, its tiers are empty but for the shared one
    elsewhere = (
        tier_llm(
            model_path, args, num_device_blocks=num_device, num_cpu_blocks=num_cpu, kv_remote=url
        )
        if url
        else None
    )
    tiers = [t for t in TIERS if url or t != "remote"]
    recompute = tier_llm(
        model_path, args, num_device_blocks=num_device, enable_prefix_caching=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    warm = common.random_prompt(rng, ids, 64)
    tiered.generate([warm], params)
    recompute.generate([warm], params)
    if elsewhere is not None:
        elsewhere.generate([warm], params)
    store = tiered.engine.core.offload

    def measure(llm: Any, prompt: list[int], tier: str) -> TierSample:
        out = llm.generate([prompt], params)[0]
        assert out.error is None, out.error
        m, ct = out.metrics, out.cached_tokens
        return TierSample(tier, m.ttft, {t: getattr(ct, t) for t in CACHED})

    def filler() -> None:
        tiered.generate([common.random_prompt(rng, ids, filler_len)], params)

    samples: list[TierSample] = []
    for rep in range(work["reps"]):
        prefix = common.random_prompt(rng, ids, plen)

        def prompt(prefix: list[int] = prefix) -> list[int]:
            return prefix + common.random_prompt(rng, ids, slen)

        tiered.generate([prompt()], params)  # computes the prefix
        filler()  # prefix: device -> CPU
        filler()  # prefix: CPU -> disk
        if store is not None:
            store.flush()  # the files and remote values are written (the reads below read them)
        samples.append(measure(tiered, prompt(), "disk"))
        if elsewhere is not None:
            samples.append(measure(elsewhere, prompt(), "remote"))
        samples.append(measure(tiered, prompt(), "device"))
        filler()  # prefix: device -> CPU
        samples.append(measure(tiered, prompt(), "cpu"))
        samples.append(measure(recompute, prompt(), "recompute"))
        print(
            f"  rep {rep + 1}: "
            + ", ".join(f"{s.tier} {1000 * s.ttft:.0f} ms" for s in samples[-len(tiers) :])
        )
        sys.stdout.flush()
    if store is not None:
        store.close()

    # NOTE: speedups are paired within a rep (the 4 measurements run back to back), then the
    # median over reps: on a shared machine the load drifts between reps far more than within.
    rows, result = [], {}
    recompute_t = [s.ttft for s in samples if s.tier == "recompute"]
    for tier in tiers:
        mine = [s for s in samples if s.tier == tier]
        t = common.p50([s.ttft for s in mine])
        speedup = common.p50([r / s.ttft for r, s in zip(recompute_t, mine, strict=True)])
        served = {k: min(s.cached[k] for s in mine) for k in CACHED}
        result[tier] = {
            "ttft_p50_s": t,
            "speedup_vs_recompute": speedup,
            "cached_tokens_min": served,
        }
        rows.append((tier, 1000 * t, f"{speedup:.1f}x", *(served[k] for k in CACHED)))
    print()
    report.print_table(
        [
            "served from",
            "TTFT p50 (ms)",
            "vs recompute (paired)",
            "device tok",
            "cpu tok",
            "disk tok",
            "remote tok",
        ],
        rows,
    )
    cpu = result["cpu"]["speedup_vs_recompute"]
    print(f"CPU-tier hit vs recompute: {cpu:.1f}x faster to first token (target >= 5x)")
    return {
        "config": {
            "num_device_blocks": num_device,
            "num_cpu_blocks": num_cpu,
            "filler_len": filler_len,
        },
        "tiers": result,
        "samples": [{"tier": s.tier, "ttft_s": s.ttft, "cached": s.cached} for s in samples],
    }


# -- part 2: multi-turn hit rates ----------------------------------------------------------------
@dataclass(slots=True)
class Session:
    prompt: list[int] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)


def run_multiturn(
    args: argparse.Namespace, model_path: str, ids: list[int], work: dict[str, Any]
) -> dict[str, Any]:
    from engine import SamplingParams

    rng = random.Random(args.seed + 1)
    n, turns, group = work["sessions"], work["turns"], work["group"]
    system = common.random_prompt(rng, ids, work["system_len"])
    users = [
        [common.random_prompt(rng, ids, rng.randint(*work["user_len"])) for _ in range(turns)]
        for _ in range(n)
    ]
    answer = work["answer_len"]
    # Working set: every session's final context (prompt of the last turn + its answer).
    final_lens = [len(system) + sum(len(u) for u in us) + turns * answer for us in users]
    working_set = sum(_blocks(x) for x in final_lens)
    quarter = max(int(args.device_fraction * working_set), group * _blocks(max(final_lens)))
    configs = {
        "cpu off": dict(num_device_blocks=quarter, cpu_swap_gib=0),
        "cpu on": dict(num_device_blocks=quarter),
        "unbounded": dict(num_device_blocks=2 * working_set, cpu_swap_gib=0),
    }
    print(
        f"  working set {working_set} blocks; device pool {quarter} blocks "
        f"({quarter / working_set:.0%}); unbounded {2 * working_set}"
    )
    engines = {name: tier_llm(model_path, args, **cfg) for name, cfg in configs.items()}
    cpu_blocks = engines["cpu on"].engine.tiers.cpu.num_blocks
    computed = {name: _count_computed(llm) for name, llm in engines.items()}
    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True)
    state = {name: [Session(list(system)) for _ in range(n)] for name in engines}
    ttfts: dict[str, list[float]] = {name: [] for name in engines}
    later: dict[str, list[float]] = {name: [] for name in engines}
    paired: list[float] = []
    """Per group of turns 2+: mean TTFT with the CPU tier off / on (run back to back)."""
    k = 0
    for turn in range(turns):
        for g in range(0, n, group):
            names = list(engines)
            names = names[k % 3 :] + names[: k % 3]  # rotate who goes first
            k += 1
            for name in names:
                sess = state[name][g : g + group]
                for s, i in zip(sess, range(g, g + group), strict=False):
                    s.prompt = s.prompt + users[i][turn]
                outs = engines[name].generate([s.prompt for s in sess], params)
                for s, out in zip(sess, outs, strict=True):
                    assert out.error is None, out.error
                    s.answers.append(list(out.token_ids))
                    s.prompt = s.prompt + list(out.token_ids)
                    ttfts[name].append(out.metrics.ttft)
                    if turn > 0:
                        later[name].append(out.metrics.ttft)
            if turn > 0:
                off_on = [common.mean(later[c][-len(outs) :]) for c in ("cpu off", "cpu on")]
                paired.append(off_on[0] / off_on[1])
        print(f"  turn {turn + 1}/{turns} done")
        sys.stdout.flush()

    result: dict[str, Any] = {}
    rows = []
    ref_rate = engines["unbounded"].engine.get_stats().prefix_hit_rate
    for name, llm in engines.items():
        st = llm.engine.get_stats()
        by_tier = {t.name: t.hits for t in st.tiers}
        result[name] = {
            "hit_rate": st.prefix_hit_rate,
            "hit_rate_vs_unbounded": st.prefix_hit_rate / ref_rate if ref_rate else 0.0,
            "hits_by_tier_tokens": by_tier,
            "prefix_queries_tokens": st.prefix_queries,
            "tokens_computed": computed[name][0],
            "ttft_mean_s": common.mean(ttfts[name]),
            "ttft_p50_s": common.p50(ttfts[name]),
            "ttft_turns_2plus_mean_s": common.mean(later[name]) if later[name] else 0.0,
            "preemptions": st.num_preemptions,
        }
        r = result[name]
        rows.append(
            (
                name,
                f"{100 * r['hit_rate']:.1f}%",
                f"{r['hit_rate_vs_unbounded']:.2f}",
                by_tier.get("cpu", 0),
                r["tokens_computed"],
                1000 * r["ttft_mean_s"],
                1000 * r["ttft_turns_2plus_mean_s"],
            )
        )
    same = all(
        a.answers == b.answers for a, b in zip(state["cpu on"], state["cpu off"], strict=True)
    ) and all(
        a.answers == b.answers for a, b in zip(state["cpu on"], state["unbounded"], strict=True)
    )
    print()
    report.print_table(
        [
            "config",
            "hit rate",
            "vs unbounded",
            "cpu hit tok",
            "tokens computed",
            "TTFT mean (ms)",
            "TTFT turns 2+ (ms)",
        ],
        rows,
    )
    print(f"identical answers across the three configs: {same}")
    on, off = result["cpu on"], result["cpu off"]
    speedup = common.p50(paired) if paired else 0.0
    print(
        f"CPU tier on vs off: TTFT turns 2+ {speedup:.2f}x faster (median over groups, paired); "
        f"hit rate {100 * on['hit_rate']:.1f}% vs {100 * off['hit_rate']:.1f}% "
        f"({on['hit_rate_vs_unbounded']:.0%} of unbounded)"
    )
    ratio = on["hit_rate_vs_unbounded"]
    print(f"hit rate with the CPU tier / unbounded device pool: {ratio:.2f} (target >= 0.90)")
    return {
        "config": {
            "working_set_blocks": working_set,
            "device_blocks": quarter,
            "cpu_blocks": cpu_blocks,
            "unbounded_blocks": 2 * working_set,
        },
        "results": result,
        "ttft_turns_2plus_off_over_on_paired_p50": speedup,
        "identical_answers": same,
    }


def _count_computed(llm: Any) -> list[int]:
    """Wraps the runner so that box[0] counts the tokens the forward passes compute."""
    box = [0]
    runner = llm.engine.core.runner
    name = "launch" if hasattr(runner, "launch") else "execute"  # execute: older runners
    run_step = getattr(runner, name)

    def counted(sched: Any, *args: Any) -> Any:
        box[0] += sched.num_tokens
        return run_step(sched, *args)

    setattr(runner, name, counted)
    return box


def run(args: argparse.Namespace) -> int:
    model_path, info = common.begin(args, "deja bench tiers")
    work = common.resolve_workload(args, FULL, QUICK)
    ids, _ = common.allowed_token_ids(model_path)
    out: dict[str, Any] = {"bench": "tiers", "model": model_path, "machine": info, "workload": work}
    start = time.perf_counter()

    parts: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
        "ttft": (
            f"TTFT of a {work['prefix_len']}-token cached prefix + {work['suffix_len']}-token "
            f"suffix by tier ({work['reps']} reps, {args.dtype}, max_tokens 1)",
            lambda: run_ttft(args, model_path, ids, work),
        ),
        "multiturn": (
            f"multi-turn: {work['sessions']} sessions x {work['turns']} turns, groups of "
            f"{work['group']}, answers of {work['answer_len']} tokens",
            lambda: run_multiturn(args, model_path, ids, work),
        ),
        "restart": (
            "first request after a restart (write-through, graceful close)",
            lambda: run_restart(args, model_path, ids, args.quick),
        ),
    }
    for name, (heading, part) in parts.items():
        if args.part in ("all", name):
            print(f"\n-- {heading} --", flush=True)  # flushed: a part runs long
            out[name] = part()
    print(f"\ntotal bench time {time.perf_counter() - start:.0f} s")
    report.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(common.main("python -m bench.tiers", __doc__, add_arguments, run))
