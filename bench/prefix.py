"""Time to first token with the prefix cache on and off.

32 requests (default) share a 1,024-token prefix, each with its own 16..32-token suffix, and ask
for 8 tokens. Two engines are loaded side by side, one with prefix caching and one without, and
the requests go one at a time, alternating between the two, so that neither engine queues and
both see the same machine load. TTFT is the engine's own arrival -> first token time (the whole
prefill step). The first request warms the cache; requests 2..N are the measurement.

    python -m bench.prefix [--model demo] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench import common, report

FULL: dict[str, Any] = {
    "num_requests": 32,
    "prefix_len": 1024,
    "suffix_len": (16, 32),
    "max_tokens": 8,
}
QUICK: dict[str, Any] = {
    "num_requests": 4,
    "prefix_len": 128,
    "suffix_len": (8, 16),
    "max_tokens": 2,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    common.add_num_requests_argument(parser, FULL["num_requests"], QUICK["num_requests"])
    parser.add_argument("--prefix-len", type=int, default=None, help="shared prefix (default 1024)")
    common.add_range_argument(parser, "--suffix-len", "distinct suffix lengths", FULL["suffix_len"])
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per request (default 8)"
    )


@dataclass(slots=True)
class Sample:
    """One request on one engine."""

    ttft: float
    """Seconds from arrival to the first token (engine metrics)."""
    e2e: float
    """Seconds from arrival to the last token."""
    cached: int
    """Prompt tokens served from the prefix cache."""
    tokens: list[int]


def make_prompts(seed: int, ids: list[int], work: dict[str, Any]) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = common.random_prompt(rng, ids, work["prefix_len"])
    return [
        prefix + common.random_prompt(rng, ids, rng.randint(*work["suffix_len"]))
        for _ in range(work["num_requests"])
    ]


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """Request 1 (the cache warmer) on its own; requests 2..N as the measurement."""
    rest = samples[1:]
    ttfts = [s.ttft for s in rest]
    return {
        "first_request_ttft_s": samples[0].ttft,
        "ttft_p50_s": common.p50(ttfts),
        "ttft_mean_s": common.mean(ttfts),
        "ttft_min_s": min(ttfts),
        "ttft_max_s": max(ttfts),
        "e2e_mean_s": common.mean([s.e2e for s in rest]),
        "cached_tokens_min": min(s.cached for s in rest),
        "cached_tokens_max": max(s.cached for s in rest),
        "first_request_cached_tokens": samples[0].cached,
    }


def run(args: argparse.Namespace) -> int:
    work = common.resolve_workload(args, FULL, QUICK)
    if work["num_requests"] < 2:
        raise SystemExit("--num-requests must be at least 2 (request 1 warms the cache)")
    model_path, info = common.begin(args, "deja bench prefix")
    from engine import SamplingParams

    ids, _ = common.allowed_token_ids(model_path)
    prompts = make_prompts(args.seed, ids, work)
    # A warm-up prompt that shares nothing with the measured ones.
    warm_prompt = common.random_prompt(random.Random(args.seed + 1_000_003), ids, 64)
    print(
        f"workload: {len(prompts)} requests, shared prefix {work['prefix_len']} tokens + distinct "
        f"suffix {work['suffix_len'][0]}..{work['suffix_len'][1]} tokens, max_tokens "
        f"{work['max_tokens']}, greedy, seed {args.seed}, {args.dtype}; sequential, alternating "
        "cache on / cache off"
    )
    sys.stdout.flush()

    blocks_per_prompt = -(-(max(len(p) for p in prompts) + work["max_tokens"]) // 16)
    num_blocks = args.num_device_blocks or max(256, 4 * blocks_per_prompt)
    engines = {
        mode: common.our_llm(
            model_path, args, num_device_blocks=num_blocks, enable_prefix_caching=(mode == "on")
        )
        for mode in ("on", "off")
    }
    params = SamplingParams(temperature=0.0, max_tokens=work["max_tokens"], ignore_eos=True)
    for llm in engines.values():
        llm.generate([warm_prompt], params)

    samples: dict[str, list[Sample]] = {"on": [], "off": []}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        # Alternate which engine goes first so neither always follows the other.
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        for mode in order:
            out = engines[mode].generate([prompt], params)[0]
            m = out.metrics
            assert m is not None and m.ttft is not None and m.e2e is not None
            samples[mode].append(Sample(m.ttft, m.e2e, out.num_cached_tokens, list(out.token_ids)))
    total = time.perf_counter() - start

    on, off = summarize(samples["on"]), summarize(samples["off"])
    same = sum(a.tokens == b.tokens for a, b in zip(samples["on"], samples["off"], strict=True))
    n_rest = len(prompts) - 1
    print()
    report.print_table(
        [
            "prefix cache",
            "TTFT req 1 (ms)",
            f"TTFT p50 req 2..{len(prompts)} (ms)",
            "mean (ms)",
            "min (ms)",
            "max (ms)",
            "cached tok/req (2..N)",
        ],
        [
            (
                mode,
                1000 * s["first_request_ttft_s"],
                1000 * s["ttft_p50_s"],
                1000 * s["ttft_mean_s"],
                1000 * s["ttft_min_s"],
                1000 * s["ttft_max_s"],
                f"{s['cached_tokens_min']}..{s['cached_tokens_max']}",
            )
            for mode, s in (("on", on), ("off", off))
        ],
    )
    print()
    ratio_p50 = off["ttft_p50_s"] / on["ttft_p50_s"]
    ratio_mean = off["ttft_mean_s"] / on["ttft_mean_s"]
    for stat, ratio in (("p50", ratio_p50), ("mean", ratio_mean)):
        print(report.ratio_line(f"ratio TTFT off / on ({stat}, requests 2..{len(prompts)})", ratio))
    print(f"identical outputs cache on vs off: {same}/{len(prompts)}")
    print(f"total bench time {total:.0f} s ({n_rest} measured requests per engine)")
    print(report.finish_info(info))

    report.write_json(
        args.json,
        {
            "bench": "prefix",
            "model": model_path,
            "machine": info,
            "workload": {**work, "seed": args.seed, "dtype": args.dtype},
            "ours_config": {
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "num_device_blocks": num_blocks,
            },
            "cache_on": on,
            "cache_off": off,
            "ratios": {"ttft_p50_off_over_on": ratio_p50, "ttft_mean_off_over_on": ratio_mean},
            "identical_outputs": same,
            "per_request": {
                mode: [{"ttft_s": s.ttft, "cached_tokens": s.cached} for s in samples[mode]]
                for mode in ("on", "off")
            },
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.main("python -m bench.prefix", __doc__, add_arguments, run))
