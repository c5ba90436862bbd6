"""fp8 KV cache against the model-dtype KV cache: greedy agreement, logprob error, capacity.

    deja bench kv-dtype [--model demo] [--dtype float32] [--prompts 16] [--max-tokens 64]
                        [--kv-cache-dtype fp8_e4m3] [--device cpu]

Runs the same chat prompts twice, greedy with ignore_eos (so every output is --max-tokens long),
once with the KV cache in the model's dtype (kv_cache_dtype=auto) and once with
--kv-cache-dtype, in one process, and prints:
- agreement: the share of output positions where both runs chose the same token (position by
  position, over all prompts; after a first difference the contexts differ, so later positions
  count only where they happen to agree again), with each prompt's first difference;
- mean |logprob error|: |logprob_fp8 - logprob_ref| of the chosen token, over the positions where
  both runs still share the whole context (up to and including each prompt's first difference);
- teacher-forced: both engines score the reference outputs (prompt + reference tokens, one
  prefill each, through the engine's own model, attention backend and KV dtype): the share of
  positions where the tested engine's top-1 is the reference token, and the mean |logprob error|
  of the reference token; free of the cascade above (every position has the same context);
- capacity: device blocks that fit the same KV budget (--device-memory-gib) for float32, bf16
  and the tested dtype, from the engine's own block sizing; and the two engines' pools.
PASS when the teacher-forced agreement is >= 90% and fp8 blocks per budget >= 2.0x bf16's (issue
27's acceptance 3). NOTE: the 90% applies to the teacher-forced figure, as the project measures
the same "token agreement" line for bf16 (tests/engine/test_bf16_families.py, `deja bench peer
--agreement`): free-running, one early near-tie changes the rest of an answer, and even
transformers' bf16 eager and sdpa attention agree on only ~54% of free-running positions on the
demo model (`deja bench peer --agreement 12` prints that yardstick). Both are printed here.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import common, report

AGREEMENT_TARGET = 0.9
CAPACITY_TARGET = 2.0
QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for better sleep.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I make a cup of green tea?",
    "What causes the seasons on Earth?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Write a haiku about autumn leaves.",
    "What is 17 multiplied by 23? Show your steps.",
    "Name five planets in our solar system.",
    "Why is the sky blue?",
    "Describe a healthy breakfast.",
    "What is machine learning, in simple words?",
    "Write a short email asking a colleague for a meeting.",
    "What are the primary colors?",
    "How does a refrigerator keep food cold?",
    "Give an example of a SQL query that counts rows.",
    "What should I pack for a weekend hiking trip?",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument("--prompts", type=int, default=16, help="chat prompts (default 16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per output (64)")
    parser.add_argument(
        "--kv-cache-dtype", default="fp8_e4m3", choices=("fp8_e4m3",), help="the tested KV dtype"
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--device-memory-gib", type=float, default=1.0, help="KV budget of both engines (1.0)"
    )


def _prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer.encode(messages[0]["content"])
        out.append([int(t) for t in ids])
    return out


def _run(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], float]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0] for o in outs], elapsed


def teacher_forced(llm: Any, seqs: list[list[int]], starts: list[int]) -> Any:
    """[sum(len(s) - start), vocab] float32 log-probs of each sequence's tokens from its start on,
    given the tokens before them: one prefill of all sequences through the engine's model and
    attention backend, over a scratch cache in the engine's KV dtype with its scales."""
    import torch

    from engine.worker.kv_calibration import prefill_meta

    eng = llm.engine.core
    kv = eng.runner.kv_cache  # [L, 2, NB, BS, Hkv, D]
    bs = kv.shape[3]
    lengths = [len(s) for s in seqs]
    meta = prefill_meta(lengths, bs, kv.device)
    num_blocks = sum(-(-n // bs) for n in lengths)
    cache = torch.zeros(
        (kv.shape[0], 2, num_blocks, *kv.shape[3:]), dtype=kv.dtype, device=kv.device
    )
    ids = torch.tensor([t for s in seqs for t in s], device=kv.device)
    pos = torch.tensor([i for n in lengths for i in range(n)], device=kv.device)
    rows: list[int] = []
    first = 0
    for n, start in zip(lengths, starts, strict=True):
        rows += range(first + start - 1, first + n - 1)  # row p predicts token p + 1
        first += n
    eng.backend.bind_kv_cache(cache, eng.kv_scales)
    try:
        with torch.inference_mode():
            eng.backend.prepare(meta)
            hidden = eng.model(ids, pos, cache, meta)
            idx = torch.tensor(rows, device=kv.device)
            return eng.model.compute_logits(hidden.index_select(0, idx)).log_softmax(-1).cpu()
    finally:
        eng.backend.bind_kv_cache(kv, eng.kv_scales)


def compare_forced(ref_lp: Any, test_lp: Any, targets: list[int]) -> dict[str, Any]:
    """Top-1 agreement with the reference tokens and |logprob error| of them, same contexts."""
    import torch

    t = torch.tensor(targets)[:, None]
    top1 = test_lp.argmax(-1) == t[:, 0]
    err = (test_lp.gather(1, t) - ref_lp.gather(1, t)).abs()
    kl = (ref_lp.exp() * (ref_lp - test_lp)).sum(-1)
    return {
        "top1_agreement": float(top1.float().mean()),
        "reference_top1": float((ref_lp.argmax(-1) == t[:, 0]).float().mean()),
        "mean_abs_logprob_error": float(err.mean()),
        "mean_kl": float(kl.mean()),
        "positions": len(targets),
    }


def compare(ref: list[Any], test: list[Any]) -> dict[str, Any]:
    """Position-by-position agreement and the logprob error over shared contexts."""
    same = total = 0
    errors: list[float] = []
    first_diff: list[int | None] = []
    for a, b in zip(ref, test, strict=True):
        diff = None
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            total += 1
            same += x == y
            if diff is None:
                errors.append(abs(a.logprobs[i].logprob - b.logprobs[i].logprob))
                if x != y:
                    diff = i
        first_diff.append(diff)
    return {
        "agreement": same / max(total, 1),
        "positions": total,
        "same": same,
        "mean_abs_logprob_error": common.mean(errors) if errors else 0.0,
        "logprob_positions": len(errors),
        "first_difference": first_diff,
        "identical_outputs": sum(d is None for d in first_diff),
    }


def run(args: argparse.Namespace) -> int:
    model_path, info = common.begin(args, f"KV cache {args.kv_cache_dtype} vs {args.dtype}")
    import torch

    from engine.worker.attention.kv_quant import kv_block_bytes, kv_storage_dtype

    n = 2 if args.quick else args.prompts
    max_tokens = 8 if args.quick else args.max_tokens
    engines: dict[str, Any] = {}
    outputs: dict[str, list[Any]] = {}
    forced: dict[str, Any] = {}
    seqs: list[list[int]] = []
    starts: list[int] = []
    for kv in ("auto", args.kv_cache_dtype):
        llm = common.our_llm(
            model_path,
            args,
            device=args.device,
            kv_cache_dtype=kv,
            device_memory_gib=args.device_memory_gib,
            num_cpu_blocks=0,
        )
        prompts = _prompts(llm.tokenizer, n)
        outputs[kv], secs = _run(llm, prompts, max_tokens)
        if kv == "auto":  # the reference outputs, scored by both engines below
            seqs = [p + o.token_ids for p, o in zip(prompts, outputs[kv], strict=True)]
            starts = [len(p) for p in prompts]
        forced[kv] = teacher_forced(llm, seqs, starts)
        eng = llm.engine.core
        engines[kv] = {
            "kv_dtype": str(eng.runner.kv_cache.dtype),
            "block_bytes": eng.block_bytes,
            "num_device_blocks": eng.model_info.num_device_blocks,
            "seconds": secs,
            "scales": None if eng.kv_scales is None else eng.kv_scales.source,
        }
        mi = eng.model_info
        print(
            f"kv_cache_dtype={kv}: {engines[kv]['kv_dtype']}, {eng.block_bytes} B/block, "
            f"{mi.num_device_blocks} blocks in {args.device_memory_gib} GiB, "
            f"{n} x {max_tokens} tokens in {secs:.1f} s"
            + (f", scales: {eng.kv_scales.source}" if eng.kv_scales is not None else "")
        )
        del llm, eng
    result = compare(outputs["auto"], outputs[args.kv_cache_dtype])
    targets = [t for s, start in zip(seqs, starts, strict=True) for t in s[start:]]
    tf = compare_forced(forced["auto"], forced[args.kv_cache_dtype], targets)
    dims = (mi.num_layers, mi.block_size, mi.num_kv_heads, mi.head_dim)
    budget = int(args.device_memory_gib * 2**30)
    fits = {
        name: budget // kv_block_bytes(*dims, dtype)
        for name, dtype in (
            ("float32", torch.float32),
            ("bfloat16", torch.bfloat16),
            (args.kv_cache_dtype, kv_storage_dtype(args.kv_cache_dtype, torch.float32)),
        )
    }
    capacity = fits[args.kv_cache_dtype] / fits["bfloat16"]
    print(
        f"agreement: {result['same']}/{result['positions']} = {100 * result['agreement']:.1f}% "
        f"of output positions ({result['identical_outputs']}/{n} outputs identical; first "
        f"differences at {result['first_difference']})"
    )
    print(
        f"mean |logprob error| of the chosen token over {result['logprob_positions']} "
        f"shared-context positions: {result['mean_abs_logprob_error']:.4f}"
    )
    print(
        f"teacher-forced over the reference outputs ({tf['positions']} positions, same "
        f"contexts): top-1 = reference token {100 * tf['top1_agreement']:.1f}% (the reference "
        f"engine itself: {100 * tf['reference_top1']:.1f}%), mean |logprob error| "
        f"{tf['mean_abs_logprob_error']:.4f}, mean KL {tf['mean_kl']:.5f}"
    )
    print(
        "blocks in the same budget: "
        + ", ".join(f"{k} {v}" for k, v in fits.items())
        + f"; {args.kv_cache_dtype} / bfloat16 = {capacity:.2f}x, / float32 = "
        f"{fits[args.kv_cache_dtype] / fits['float32']:.2f}x"
    )
    ok = tf["top1_agreement"] >= AGREEMENT_TARGET and capacity >= CAPACITY_TARGET
    print(
        f"{'PASS' if ok else 'FAIL'}: teacher-forced agreement {100 * tf['top1_agreement']:.1f}% "
        f"(target >= {100 * AGREEMENT_TARGET:.0f}%; free-running "
        f"{100 * result['agreement']:.1f}%), capacity {capacity:.2f}x bf16 (target >= "
        f"{CAPACITY_TARGET}x)"
    )
    print(report.finish_line(info))
    report.write_json(
        args.json,
        {
            "engines": engines,
            "comparison": result,
            "teacher_forced": tf,
            "blocks_per_budget": fits,
            "capacity_vs_bf16": capacity,
            "verdict": "PASS" if ok else "FAIL",
            "machine": info,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.main("deja bench kv-dtype", __doc__, add_arguments, run))
