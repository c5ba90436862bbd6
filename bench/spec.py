"""Speculative decoding against plain decoding: the same requests, one run, one process.

    deja bench spec [--model demo] [--dtype bfloat16] [--method ngram|suffix]
                    [--num-speculative-tokens 8] [--threads 2]

Builds our engine twice (without speculation, then with `--speculative-config {"method": M,
"num_speculative_tokens": K}`) and runs three workloads on each, greedy:
- quoting: a chat request whose prompt holds a piece of code and asks for it back with one
  change; batch 1, one request at a time (decode tok/s: output tokens after the first over the
  time after the first);
- multi-turn chat: sessions of three turns, each turn's prompt the conversation so far (the
  model's own earlier answers included) and a follow-up that asks to restate or extend it;
  batch 1 (decode tok/s over every turn);
- random: 32 prompts of random tokens decoded together (output tok/s of the batch, best of 3,
  the two engines alternating).
Each engine runs the quoting workload once untimed first (as another tenant: suffix decoding's
corpus does not hold those answers), so every step shape has run before the timed passes. It prints each workload's figures, their ratio (with / without), the acceptance rate and mean
tokens per verifying step, how many outputs are token-identical and the share of tokens before
the first difference ("agree"; bfloat16 changes the numerics of a multi-token step, so a near
tie may break the other way, and every later token of that output follows the new path), and
the teacher-forced top-1 agreement of a multi-token pass with the plain decode's tokens.
"""

from __future__ import annotations

import argparse
import random
import time
from itertools import takewhile
from pathlib import Path
from typing import Any

from bench import common, report

QUOTING_TARGET = 2.0
CHAT_TARGET = 1.2
RANDOM_TARGET = 0.97

_CODE_FILE = Path(__file__).resolve().parent.parent / "engine" / "kv" / "block_pool.py"
"""The code the quoting workload hands the model (a file of this package)."""

FOLLOW_UPS = [
    "Repeat your last answer word for word, then add one more sentence.",
    "Summarize what you just said, reusing your own words.",
]
QUESTIONS = [
    "What is a hash table? Explain in a short paragraph.",
    "Explain how a linked list works.",
    "What does a compiler do? Answer in a few sentences.",
    "Describe how HTTP caching works.",
]
CHANGES = [
    "rename the variable `block` to `blk`",
    "add a type hint to every argument",
    "change every docstring to a one-line comment",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser, dtype="bfloat16")
    parser.add_argument("--method", default="ngram", choices=("ngram", "suffix"))
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256, help="per quoting/chat turn")
    parser.add_argument("--batch", type=int, default=32, help="random workload's batch (32)")


def _chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def _code_snippets(n: int) -> list[str]:
    lines = _CODE_FILE.read_text().splitlines()
    out = []
    for i in range(n):
        start = 20 + 37 * i
        out.append("\n".join(lines[start : start + 30]))
    return out


def quoting(
    llm: Any, tokenizer: Any, params: Any, quick: bool, salt: str | None = None
) -> dict[str, Any]:
    """Batch-1 decode over requests that ask for a piece of code back with one change."""
    prompts = [
        _chat(
            tokenizer,
            [
                {
                    "role": "user",
                    "content": f"Here is some Python code:\n\n```python\n{code}\n```\n\n"
                    f"Rewrite it and {change}. Reply with the whole code only.",
                }
            ],
        )
        for code, change in zip(_code_snippets(3), CHANGES, strict=True)
    ]
    prompts = prompts[:1] if quick else prompts
    outs = [llm.generate([p], params, cache_salt=salt)[0] for p in prompts]
    return {**_decode_rate(outs), "prompts": prompts}


def _decode_rate(outs: list[Any]) -> dict[str, Any]:
    """Batch-1 decode over requests run one at a time: output tokens after the first over the
    time after the first."""
    tokens = sum(len(o.token_ids) - 1 for o in outs)
    seconds = sum(o.metrics.finished - o.metrics.first_token for o in outs)
    return {
        "tok_s": tokens / max(seconds, 1e-9),
        "tokens": tokens,
        "outputs": [o.token_ids for o in outs],
    }


def chat(llm: Any, tokenizer: Any, params: Any, quick: bool) -> dict[str, Any]:
    """Batch-1 decode over three-turn sessions whose follow-ups ask the model to restate."""
    outs = []
    for question in QUESTIONS[:1] if quick else QUESTIONS:
        messages = [{"role": "user", "content": question}]
        for follow_up in [None, *FOLLOW_UPS]:
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
            out = llm.generate([_chat(tokenizer, messages)], params)[0]
            outs.append(out)
            messages.append({"role": "assistant", "content": out.text})
    return _decode_rate(outs)


def random_batch(llms: dict[str, Any], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Output tok/s of random-token prompts decoded together, best of 3 per engine, the engines
    alternating (this kind of VM drifts by several percent within minutes)."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8 if args.quick else 64, ignore_eos=True)
    batch = 4 if args.quick else args.batch
    vocab = int(next(iter(llms.values())).engine.core.model_info.vocab_size)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(128)] for _ in range(batch)]
    best = dict.fromkeys(llms, float("inf"))
    outs: dict[str, Any] = {}
    for llm in llms.values():
        llm.generate(prompts[:2], params)  # warm-up
    for _ in range(3):
        for name, llm in llms.items():
            start = time.perf_counter()
            outs[name] = llm.generate(prompts, params)
            best[name] = min(best[name], time.perf_counter() - start)
    out = {}
    for name in llms:
        tokens = sum(len(o.token_ids) for o in outs[name])
        out[name] = {
            "tok_s": tokens / best[name],
            "tokens": tokens,
            "outputs": [o.token_ids for o in outs[name]],
        }
    return out


def _run_all(llm: Any, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from engine import SamplingParams

    tokenizer = llm.engine.core.tokenizer
    turn = SamplingParams(temperature=0.0, max_tokens=16 if args.quick else args.max_tokens)
    # Warm-up: the quoting workload once, so every step shape (1 + k tokens) has run before
    # the timed passes (the first run of a shape sets up its kernels); as another tenant, so
    # suffix decoding's timed passes do not find these answers in their corpus.
    quoting(llm, tokenizer, turn, args.quick, salt="warm-up")
    res = {
        "quoting": quoting(llm, tokenizer, turn, args.quick),
        "chat": chat(llm, tokenizer, turn, args.quick),
    }
    stats = llm.engine.get_stats().spec
    if stats is not None:
        res["spec"] = {
            "acceptance_rate": stats.acceptance_rate,
            "mean_acceptance_length": stats.mean_acceptance_length,
            "num_drafts": stats.num_drafts,
            "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
        }
    return res


def _multi_token_agreement(llm: Any, quoting_run: dict[str, Any]) -> dict[str, Any]:
    """How often a forward over many tokens at once (what verification runs) picks the token a
    one-token decode step picked: the plain engine's quoting outputs, scored teacher-forced."""
    from bench.kv_dtype import compare_forced, teacher_forced

    seqs, starts, targets = [], [], []
    for prompt, out in zip(quoting_run["prompts"], quoting_run["outputs"], strict=True):
        seqs.append(prompt + out)
        starts.append(len(prompt))
        targets += out
    lp = teacher_forced(llm, seqs, starts)
    return compare_forced(lp, lp, targets)


def _agreed(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference."""
    return sum(1 for _ in takewhile(lambda p: p[0] == p[1], zip(a, b, strict=False)))


def run(args: argparse.Namespace) -> int:
    model_path, info = common.begin(args, f"speculative decoding ({args.method}) vs plain decode")
    spec = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    runs: dict[str, dict[str, Any]] = {}
    forced: dict[str, Any] = {}
    llms = {}
    for name, options in (("plain", {}), ("spec", {"speculative_config": spec})):
        llm = llms[name] = common.our_llm(model_path, args, **options)
        runs[name] = _run_all(llm, args)
        if name == "plain":
            forced = _multi_token_agreement(llm, runs[name]["quoting"])
    for name, res in random_batch(llms, args).items():
        runs[name]["random"] = res
    del llms
    plain, spec_run = runs["plain"], runs["spec"]
    targets = {"quoting": QUOTING_TARGET, "chat": CHAT_TARGET, "random": RANDOM_TARGET}
    rows = []
    summary: dict[str, Any] = {}
    for name, target in targets.items():
        a, b = plain[name], spec_run[name]
        ratio = b["tok_s"] / a["tok_s"]
        pairs = list(zip(a["outputs"], b["outputs"], strict=True))
        same = sum(x == y for x, y in pairs)
        # Of the plain outputs' tokens, the share before the first difference.
        agreed = sum(_agreed(x, y) for x, y in pairs)
        prefix = agreed / max(1, sum(len(x) for x, _ in pairs))
        rows.append(
            [name, f"{a['tok_s']:.1f}", f"{b['tok_s']:.1f}", f"{ratio:.2f}x", f">= {target}x",
             f"{same}/{len(a['outputs'])}", f"{100 * prefix:.1f}%"]
        )  # fmt: skip
        summary[name] = {
            "plain_tok_s": a["tok_s"],
            "spec_tok_s": b["tok_s"],
            "ratio": ratio,
            "target": target,
            "identical_outputs": same,
            "tokens_before_first_difference": prefix,
            "outputs": len(a["outputs"]),
        }
    report.print_table(
        ["workload", "plain tok/s", "spec tok/s", "ratio", "target", "identical", "agree"], rows
    )
    s = spec_run.get("spec", {})
    print(
        f"acceptance rate {100 * s.get('acceptance_rate', 0):.1f}%, mean tokens per verifying "
        f"step {s.get('mean_acceptance_length', 0):.2f}, proposals {s.get('num_drafts', 0)}"
    )
    print(
        f"a multi-token pass's top-1 equals the one-token decode's token at "
        f"{100 * forced['top1_agreement']:.2f}% of {forced['positions']} positions (quoting "
        f"outputs, teacher-forced, {args.dtype})"
    )
    print(report.finish_line(info))
    report.write_json(
        args.json,
        {"workloads": summary, "spec": s, "multi_token_agreement": forced, "machine": info},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.main("deja bench spec", __doc__, add_arguments, run))
