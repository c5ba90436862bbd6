"""`deja bench window`: KV blocks a long sequence holds under sliding-window attention.

One request (a `--prompt-len`-token random prompt, `--max-tokens` greedy tokens, the prompt
prefilled in chunks of `--max-num-batched-tokens`) on two tiny random Mistral models that differ
only in `sliding_window`: `--window` (every layer slides, one layer group: the KV manager releases
blocks that fell out of the window) and none (full attention). After every step it reads the
blocks in use (reference count > 0) and prints the peaks while prefilling and while decoding,
against the bound the issue sets: window / block_size + 1 blocks per layer group.

    deja bench window [--window 256] [--prompt-len 2048] [--max-tokens 32] [--block-size 16]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

from bench import common, report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window", type=int, default=256, help="sliding window (positions)")
    parser.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=32, help="generated tokens")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=256, help="token budget per step (chunks)"
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the models are built")
    parser.add_argument("--threads", type=int, default=common.DEFAULT_THREADS)
    common.add_json_argument(parser)


def _model(cache: Path, window: int | None, max_positions: int) -> str:
    """A tiny random Mistral (engine/testing/tiny_models.py) with this window, built once per setting."""
    from engine.testing.tiny_models import build_tiny_mistral

    out = cache / f"tiny-mistral-w{window}-p{max_positions}"
    if not (out / "config.json").exists():
        build_tiny_mistral(out, sliding_window=window, max_position_embeddings=max_positions)
    return str(out)


def measure(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs the request step by step; returns the peak blocks in use while prefilling and
    decoding (and the output tokens)."""
    from engine import LLM, SamplingParams

    total = args.prompt_len + args.max_tokens
    llm = LLM(
        path,
        dtype="float32",
        block_size=args.block_size,
        num_device_blocks=-(-total // args.block_size) + 8,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    rng = random.Random(0)
    prompt = [rng.randrange(10, 500) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = llm.engine
    engine.add_request(prompt, params)
    pool = engine.core.kv.pool
    peaks = {"prefill": 0, "decode": 0}
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        deltas = engine.step()
        # A step that produced no token yet was a prefill chunk; later ones decode.
        phase = "decode" if tokens else "prefill"
        peaks[phase] = max(peaks[phase], pool.num_used)
        for delta in deltas:
            tokens += delta.token_ids
    return {
        "peak_blocks_prefill": peaks["prefill"],
        "peak_blocks_decode": peaks["decode"],
        "kv_window": engine.core.kv.sliding_window,
        "output_tokens": len(tokens),
    }


def run(args: argparse.Namespace) -> int:
    common.setup_torch(args.threads)
    cache = args.cache_dir or common.default_cache_dir()
    max_positions = max(4096, args.prompt_len + args.max_tokens)
    info = report.machine_info(args.threads)
    report.print_header("sliding-window KV blocks", "tiny random Mistral (2 layers)", info)
    bound = -(-args.window // args.block_size) + 1
    results = {}
    for name, window in (("window", args.window), ("full", None)):
        results[name] = measure(_model(cache, window, max_positions), args)
    rows = [
        [
            f"sliding_window={args.window}" if name == "window" else "full attention",
            r["peak_blocks_prefill"],
            r["peak_blocks_decode"],
        ]
        for name, r in results.items()
    ]
    print(
        f"one {args.prompt_len}-token prompt + {args.max_tokens} tokens, block_size "
        f"{args.block_size}, chunks of {args.max_num_batched_tokens} tokens"
    )
    report.print_table(["model", "peak blocks (prefill)", "peak blocks (decode)"], rows)
    held = results["window"]["peak_blocks_decode"]
    ok = held <= bound
    print(
        f"blocks in use for a {args.prompt_len}-token sequence with window {args.window}: "
        f"{held} (bound window/block_size + 1 = {bound} per layer group, 1 group): "
        f"{'ok' if ok else 'OVER'}"
    )
    report.write_json(args.json, {"bound": bound, "within_bound": ok, **results})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(common.main("deja bench window", __doc__, add_arguments, run))
