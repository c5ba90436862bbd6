"""KV blocks a beam-search request holds, against one greedy request on the same prompt.

One random prompt of 512 tokens (default) and max_tokens 32, run to max_tokens (ignore_eos, so
every beam lives to the end: the most blocks a search can hold). First one greedy request, then
one beam search of width 4 (early_stopping=True), each alone on the engine. After every scheduling
decision the blocks in use are read; the peak is the request's footprint. Beams share the
prompt's blocks through reference counts and copy the partly filled tail on write, so the target
is a peak of at most 1.3x the greedy request's.

    python -m bench.beam [--model demo] [--prompt-len 512] [--beams 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from bench import common, report

FULL: dict[str, Any] = {"prompt_len": 512, "max_tokens": 32, "beams": 4}
QUICK: dict[str, Any] = {"prompt_len": 128, "max_tokens": 8, "beams": 4}
TARGET = 1.3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512)")
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens (default 32)")
    parser.add_argument("--beams", type=int, default=None, help="beam width (default 4)")


def peak_blocks(llm: Any, prompt: list[int], params: Any) -> tuple[int, float, Any]:
    """(peak blocks in use after any scheduling decision, seconds, output) of one request."""
    eng = llm.engine.core
    schedule = eng.scheduler.schedule
    peak = 0

    def tracked() -> Any:
        nonlocal peak
        out = schedule()
        peak = max(peak, eng.kv.pool.num_used)
        return out

    eng.scheduler.schedule = tracked
    try:
        t0 = time.perf_counter()
        (out,) = llm.generate([prompt], params)
        elapsed = time.perf_counter() - t0
    finally:
        del eng.scheduler.schedule  # the instance attribute shadowed the method
    assert eng.kv.pool.num_used == 0, "a request left blocks in use"
    return peak, elapsed, out


def run(args: argparse.Namespace) -> int:
    work = common.resolve_workload(args, FULL, QUICK)
    model_path, info = common.begin(args, "deja bench beam")
    from engine import SamplingParams

    ids, _ = common.allowed_token_ids(model_path)
    prompt = common.random_prompt(random.Random(args.seed), ids, work["prompt_len"])
    width, max_tokens = work["beams"], work["max_tokens"]
    block_size = 16
    print(
        f"workload: one prompt of {len(prompt)} tokens, max_tokens {max_tokens} (ignore_eos), "
        f"greedy vs beam search width {width}, block size {block_size}, {args.dtype}"
    )
    sys.stdout.flush()
    llm = common.our_llm(
        model_path, args, num_device_blocks=args.num_device_blocks or 1024, block_size=block_size
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    beam = SamplingParams(
        n=width,
        temperature=0.0,
        use_beam_search=True,
        early_stopping=True,
        max_tokens=max_tokens,
        ignore_eos=True,
    )
    g_peak, g_s, g_out = peak_blocks(llm, prompt, greedy)
    b_peak, b_s, b_out = peak_blocks(llm, prompt, beam)
    ratio = b_peak / g_peak
    print()
    report.print_table(
        ["request", "peak KV blocks held", "seconds", "outputs"],
        [
            ("greedy", g_peak, g_s, 1),
            (f"beam search, width {width}", b_peak, b_s, len(b_out.outputs)),
        ],
    )
    print()
    print(report.ratio_line(f"ratio KV blocks beam {width} / greedy (peak)", ratio))
    verdict = "meets" if ratio <= TARGET else "misses"
    print(f"{verdict} the target of <= {TARGET}x")
    same = b_out.outputs[0].token_ids == g_out.token_ids
    print(f"best beam equals the greedy output: {same}")
    print(report.finish_info(info))
    report.write_json(
        args.json,
        {
            "bench": "beam",
            "model": model_path,
            "machine": info,
            "workload": {**work, "seed": args.seed, "dtype": args.dtype, "block_size": block_size},
            "greedy": {"peak_blocks": g_peak, "seconds": g_s},
            "beam": {"peak_blocks": b_peak, "seconds": b_s, "width": width},
            "ratios": {"peak_blocks_beam_over_greedy": ratio},
            "meets_target": ratio <= TARGET,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.main("python -m bench.beam", __doc__, add_arguments, run))
