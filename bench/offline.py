"""Offline throughput: our engine against transformers `generate` and `generate_batch`.

One run, one workload (default: 64 requests, prompts uniform in [32, 512] tokens, outputs uniform
in [16, 128] tokens, random token ids from a fixed seed, greedy, EOS ignored) through:

- ours: `LLM.generate` with one SamplingParams per request (max_tokens = its output length);
- transformers `generate` in padded static batches (left padding + attention mask); each batch runs
  to its longest output and only each request's own tokens count as useful output;
- transformers continuous batching (`ContinuousBatchingManager`, the engine behind
  `generate_batch`), sized explicitly and reused, with per-request max_new_tokens.

Each system is warmed up once on other prompts before it is timed. Throughput = useful output
tokens / wall time of the whole workload (prefill included). Ratios are what to read: all three
run in the same process, minutes apart, on the same requests.

    python -m bench.offline [--model demo] [--json out.json]

With --compare-disk-write-through, ours also runs with a disk tier (write-through, a fresh temp
directory per run) on the same requests, alternating with runs without one (`--compare-reps`
each, the order flipped every repetition); both medians and the on/off throughput ratio (median of
the paired ratios; target >= 0.97) are printed. Add --skip-generate --skip-generate-batch
--parity 0 to leave transformers out. The transformers side is bench/hf_baselines.py.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from bench import common, report
from bench.hf_baselines import check_parity, load_hf_model, run_hf_generate, run_hf_generate_batch

FULL: dict[str, Any] = {
    "num_requests": 64,
    "prompt_len": (32, 512),
    "output_len": (16, 128),
    "batch_size": 8,
}
QUICK: dict[str, Any] = {
    "num_requests": 8,
    "prompt_len": (8, 48),
    "output_len": (4, 16),
    "batch_size": 4,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    common.add_num_requests_argument(parser, FULL["num_requests"], QUICK["num_requests"])
    parser.add_argument(
        "--batch-size", type=int, default=None, help="transformers generate batch (default 8)"
    )
    common.add_range_argument(parser, "--prompt-len", "prompt lengths", FULL["prompt_len"])
    common.add_range_argument(parser, "--output-len", "output lengths", FULL["output_len"])
    parser.add_argument(
        "--skip-generate", action="store_true", help="leave out transformers generate"
    )
    parser.add_argument(
        "--skip-generate-batch", action="store_true", help="leave out transformers generate_batch"
    )
    parser.add_argument(
        "--parity",
        type=int,
        default=4,
        help="requests checked token by token against unpadded transformers generate (0: none)",
    )
    parser.add_argument(
        "--compare-disk-write-through",
        action="store_true",
        help="also run ours with a write-through disk tier (temp dir), interleaved, and print "
        "the throughput ratio with / without",
    )
    parser.add_argument(
        "--compare-reps",
        type=int,
        default=None,
        help="runs of ours with and without the disk tier each (default 3, 1 with --quick)",
    )
    parser.add_argument(
        "--cb-page-size", type=int, default=16, help="transformers CB page size in tokens"
    )
    parser.add_argument(
        "--cb-num-blocks",
        type=int,
        default=None,
        help="transformers CB capacity in pages (default: every request at once)",
    )
    parser.add_argument(
        "--cb-max-batch-tokens",
        type=int,
        default=512,
        help="transformers CB token budget per step",
    )
    parser.add_argument(
        "--cb-max-requests",
        type=int,
        default=None,
        help="transformers CB sequences per step (default: all requests)",
    )


# -- ours --------------------------------------------------------------------------------------
def run_ours(
    model_path: str,
    args: argparse.Namespace,
    requests: list[common.Request],
    warmup: list[common.Request],
    disk_dir: str | None = None,
) -> tuple[common.SystemResult, int]:
    """Returns the result and the prompt tokens served from the prefix cache (expected 0).

    `disk_dir`: with a write-through disk tier there (its writes queued during the timed run
    are flushed after the clock stops, at close).
    """
    from engine import SamplingParams

    llm = common.our_llm(
        model_path,
        args,
        num_device_blocks=args.num_device_blocks,
        disk_dir=disk_dir,
        disk_write_policy="write-through",
    )

    def params(reqs: list[common.Request]) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs
        ]

    llm.generate([r.prompt for r in warmup], params(warmup))
    with common.timed() as t:
        outs = llm.generate([r.prompt for r in requests], params(requests))
    tokens = [list(o.token_ids) for o in outs]
    cached = sum(o.num_cached_tokens for o in outs)
    name = "deja (ours)"
    if disk_dir is not None:
        assert llm.engine.core.tiers is not None
        counts = llm.engine.core.tiers.counters
        name = (
            f"deja (ours) + disk write-through ({counts.disk_writes} blocks queued, "
            f"{counts.dropped_writes} dropped)"
        )
    llm.engine.close()
    del llm
    gc.collect()
    n = sum(len(x) for x in tokens)
    return common.SystemResult(name, t.wall, t.cpu, n, n, tokens), cached


def compare_disk_write_through(
    model_path: str,
    args: argparse.Namespace,
    requests: list[common.Request],
    warmup: list[common.Request],
    reps: int,
) -> tuple[common.SystemResult, common.SystemResult, dict[str, Any]]:
    """Ours without and with a write-through disk tier, alternating (off, on / on, off, ...).

    Returns the median-throughput run of each and the comparison's figures.
    """
    runs: dict[bool, list[common.SystemResult]] = {False: [], True: []}
    for r in range(reps):
        for on in (False, True) if r % 2 == 0 else (True, False):
            disk_dir = tempfile.mkdtemp(prefix="deja-bench-offline-") if on else None
            # fresh directory each run: files of an earlier run would be prefix-cache hits
            try:
                res, cached = run_ours(model_path, args, requests, warmup, disk_dir)
            finally:
                if disk_dir is not None:
                    shutil.rmtree(disk_dir, ignore_errors=True)
            assert cached == 0, f"prefix-cache hits in a fresh engine: {cached}"
            runs[on].append(res)
            print(
                f"  rep {r + 1}/{reps}: {'with' if on else 'without'} disk tier "
                f"{res.tokens_per_s:.1f} tok/s ({res.seconds:.1f} s)",
                flush=True,
            )
    paired = [a.tokens_per_s / b.tokens_per_s for a, b in zip(runs[True], runs[False], strict=True)]

    def median_run(rs: list[common.SystemResult]) -> common.SystemResult:
        return sorted(rs, key=lambda x: x.tokens_per_s)[len(rs) // 2]

    off, with_disk = median_run(runs[False]), median_run(runs[True])
    same = sum(a == b for a, b in zip(off.outputs, with_disk.outputs, strict=True))
    figures = {
        "reps": reps,
        "tokens_per_s_without": [x.tokens_per_s for x in runs[False]],
        "tokens_per_s_with": [x.tokens_per_s for x in runs[True]],
        "ratio_with_over_without": statistics.median(paired),
        "paired_ratios": paired,
        "identical_outputs": same,
    }
    return off, with_disk, figures


# -- the report --------------------------------------------------------------------------------
def print_comparison(
    ours: common.SystemResult,
    gen: common.SystemResult | None,
    cb: common.SystemResult | None,
    disk_cmp: dict[str, Any],
    parity: list[dict[str, Any]],
    num_requests: int,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Prints the ratios against the baselines (and the disk tier's), output agreement and
    parity; returns the ratios and the identical-output counts."""
    ratios: dict[str, float] = {}
    if disk_cmp:
        ratios["ours_disk_write_through_over_without"] = disk_cmp["ratio_with_over_without"]
        print(
            "ratio ours with / without the disk tier (write-through): "
            f"{disk_cmp['ratio_with_over_without']:.3f}x (median of {disk_cmp['reps']} paired "
            f"runs: {', '.join(f'{x:.3f}' for x in disk_cmp['paired_ratios'])}; target >= 0.97); "
            f"identical outputs {disk_cmp['identical_outputs']}/{num_requests}"
        )
    for base_name, base in (("generate", gen), ("generate_batch", cb)):
        if base is not None:
            key = f"ours_over_{base_name}"
            ratios[key] = ours.tokens_per_s / base.tokens_per_s
            ratios[f"{key}_cpu_time"] = ours.tokens_per_cpu_s / base.tokens_per_cpu_s
            print(report.ratio_line(f"ratio ours / {base_name}", ratios[key]))
    if ratios:
        cpu_ratios = [
            f"{k.removesuffix('_cpu_time')} {v:.2f}x"
            for k, v in ratios.items()
            if k.endswith("_cpu_time")
        ]
        if cpu_ratios:
            print(f"(same ratios per CPU second: {', '.join(cpu_ratios)})")
    agreement: dict[str, Any] = {}
    for other in (gen, cb):
        if other is not None:
            same = sum(a == b for a, b in zip(ours.outputs, other.outputs, strict=True))
            agreement[other.name] = same
            print(f"identical outputs, ours vs {other.name}: {same}/{num_requests}")
    if parity:
        ok = sum(c["identical"] for c in parity)
        detail = ", ".join(
            f"#{c['request']} ({c['prompt_tokens']}+{c['output_tokens']} tok) "
            + ("same" if c["identical"] else f"differs at {c['first_mismatch']}")
            for c in parity
        )
        print(
            f"greedy parity vs transformers generate (batch 1, unpadded): {ok}/{len(parity)} identical: {detail}"
        )
    return ratios, agreement


# -- the benchmark -----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    model_path, info = common.begin(args, "deja bench offline")
    work = common.resolve_workload(args, FULL, QUICK)
    ids, _ = common.allowed_token_ids(model_path)
    requests = common.make_requests(
        args.seed, ids, work["num_requests"], work["prompt_len"], work["output_len"]
    )
    # Different prompts for the warm-up, so nothing of the timed run is in any cache.
    warmup = common.make_requests(args.seed + 1_000_003, ids, 4, work["prompt_len"], (4, 8))
    print(
        f"workload: {len(requests)} requests, prompt tokens {sum(len(r.prompt) for r in requests)} "
        f"(uniform {work['prompt_len'][0]}..{work['prompt_len'][1]}), output tokens "
        f"{sum(r.max_tokens for r in requests)} (uniform {work['output_len'][0]}.."
        f"{work['output_len'][1]}), seed {args.seed}, greedy, ignore_eos, {args.dtype}"
    )
    sys.stdout.flush()

    results: list[common.SystemResult] = []
    start = time.perf_counter()
    disk_cmp: dict[str, Any] = {}
    if args.compare_disk_write_through:
        reps = args.compare_reps or (1 if args.quick else 3)
        ours, with_disk, disk_cmp = compare_disk_write_through(
            model_path, args, requests, warmup, reps
        )
        results += [ours, with_disk]
        cached = 0
    else:
        ours, cached = run_ours(model_path, args, requests, warmup)
        results.append(ours)
    print(f"  {ours.name}: {ours.seconds:.1f} s (prefix-cache hit tokens: {cached})", flush=True)
    model = None
    if not (args.skip_generate and args.skip_generate_batch and args.parity == 0):
        model = load_hf_model(model_path, args.dtype)
    gen: common.SystemResult | None = None
    if not args.skip_generate:
        gen = run_hf_generate(model, requests, warmup, work["batch_size"])
        results.append(gen)
        print(f"  {gen.name}: {gen.seconds:.1f} s", flush=True)
    cb: common.SystemResult | None = None
    if not args.skip_generate_batch:
        cb = run_hf_generate_batch(model, args, requests, warmup)
        results.append(cb)
        print(f"  {cb.name}: {cb.seconds:.1f} s", flush=True)
    parity = check_parity(model, requests, ours.outputs, args.parity) if model is not None else []
    total = time.perf_counter() - start

    print()
    report.print_table(
        ["system", "wall s", "cpu s", "useful out tok", "computed out tok", "tok/s", "tok/cpu-s"],
        [
            (
                r.name,
                r.seconds,
                r.cpu_seconds,
                r.useful_tokens,
                r.computed_tokens,
                r.tokens_per_s,
                r.tokens_per_cpu_s,
            )
            for r in results
        ],
    )
    print()
    ratios, agreement = print_comparison(ours, gen, cb, disk_cmp, parity, len(requests))
    print(f"total bench time {total:.0f} s")
    print(report.finish_info(info))

    report.write_json(
        args.json,
        {
            "bench": "offline",
            "model": model_path,
            "machine": info,
            "workload": {**work, "seed": args.seed, "dtype": args.dtype},
            "ours_config": {
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "num_device_blocks": args.num_device_blocks,
            },
            "results": {r.name: r.to_json() for r in results},
            "ratios": ratios,
            "prefix_cache_hit_tokens": cached,
            "identical_outputs": agreement,
            "parity": parity,
            "disk_write_through": disk_cmp,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.main("python -m bench.offline", __doc__, add_arguments, run))
