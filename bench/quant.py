"""A GGUF file's weights kept quantized against the same file expanded to the compute dtype.

    deja bench quant [--model demo-gguf | FILE.gguf] [--dtype bfloat16] [--requests 48]
                     [--decode-tokens 128] [--threads 2] [--llama-bench PATH]

Loads the file three times in one process (`--quantization none`: every weight expanded to
--dtype, as a 16-bit checkpoint would be served; `--quantization gguf`: 4-bit and Q8_0 linears
kept in their groups, the embedding in its blocks or the tied head's; the same with
`--activations int8`: the kept linears multiply int8-quantized activations, as llama.cpp does)
and, for each, measures offline:
- batch-1 decode: one 64-token prompt, --decode-tokens greedy tokens, best of 3 (tok/s);
- throughput: --requests prompts of 128 tokens, 64 output tokens each, one generate (output tok/s);
- TTFT: one 512-token prompt, the time to its first token (best of 3);
- with --depths D1,D2,..: batch-1 decode after a D-token prompt (a long chat's context; best of 2);
- resident weight bytes (parameters, buffers and packed weights) against the file's tensors.
Then the teacher-forced agreement of each kept run with the expanded one (both score the
expanded engine's greedy outputs: the share of positions where the kept engine's top-1 is
that token; the kept linears score every row with the product a decode step takes), the machine's memory read rate (a large tensor summed with --threads) and each
decode's fraction of the weight-read limit (read rate / resident weight bytes a token).

With --llama-bench (a llama.cpp build's `llama-bench`; llama-cpp-python's sdist vendors the
tree: see the benchmarks page), llama.cpp runs on the same file with --threads in the same run:
its tg (--decode-tokens generated) against deja's batch-1 decode with the weights kept (each
activation mode), its tg at each of --depths (`llama-bench -d`) against deja's at that depth, and
its
pp512 against deja's 512-token TTFT (prompt tokens per second). With --llama-server, the file is
then served by both, deja behind its SMG gateway (bench/quant_served.py), under one streamed chat
workload with shared prefixes at --served-concurrency (8): output throughput and TTFT.
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack
from typing import Any

from bench import common, quant_served, report
from bench.kv_dtype import compare_forced, teacher_forced

DECODE_TARGET = 2.0
THROUGHPUT_TARGET = 1.3
RESIDENT_TARGET = 1.25
AGREEMENT_TARGET = 0.97
AGREEMENT_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain how a refrigerator keeps food cold.",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "List three benefits of regular exercise:",
    "Translate to French: Good morning, how are you?",
    "The largest planet in our solar system is",
    "Water boils at a temperature of",
    "Summarize the plot of Romeo and Juliet.",
    "What is machine learning?",
    "Give me a recipe for pancakes.",
    "import numpy as np\n",
    "The history of the Roman Empire",
    "Dear customer, thank you for",
    "How do I reverse a list in Python?",
    "The best way to learn a language is",
    "In 1969, astronauts",
    "Describe a sunset over the ocean.",
    "SELECT * FROM users WHERE",
    "My favorite book is",
    "The human heart has four chambers:",
    "Tips for a job interview:",
)
"""Text the expanded model continues greedily (AGREEMENT_TOKENS tokens each); every run scores
those tokens. 1,536 positions: near 97% a binomial standard error of 0.4%."""
AGREEMENT_TOKENS = 64
"""Greedy tokens a prompt of AGREEMENT_PROMPTS (8 with --quick)."""
MODES = {"none": ("none", "float"), "gguf": ("gguf", "float"), "gguf-int8": ("gguf", "int8")}
"""Each run: (--quantization, --activations)."""
KEPT = {"gguf": "quantized", "gguf-int8": "quantized, int8 activations"}
"""The kept runs and how the report names them."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.set_defaults(model="demo-gguf", dtype="bfloat16")
    parser.add_argument("--requests", type=int, default=48, help="throughput requests (48)")
    parser.add_argument("--decode-tokens", type=int, default=128, help="batch-1 tokens (128)")
    parser.add_argument(
        "--depths",
        type=_depths,
        default=(),
        help="context lengths to decode after too, comma-separated (none)",
    )
    parser.add_argument(
        "--llama-bench", default=None, help="llama.cpp's llama-bench binary: run it on the file too"
    )
    quant_served.add_arguments(parser)


def _depths(text: str) -> tuple[int, ...]:
    depths = tuple(int(d) for d in text.split(",") if d.strip())
    if any(d <= 0 for d in depths):
        raise argparse.ArgumentTypeError(f"depths must be positive token counts, got {text!r}")
    return depths


def llama_bench(
    binary: str, file: str, threads: int, tokens: int, depths: tuple[int, ...] = ()
) -> dict[str, float] | str:
    """llama.cpp's tg<tokens> and pp512 on `file` (tokens per second, mean of 3 repetitions; each
    its own llama-bench call), and tg<tokens> after each of `depths` tokens of context
    ("tg_tok_s@D"); or why llama-bench gave no decode figure (e.g. a build for instructions this
    CPU refuses: SIGILL). A failed pp512 or depth call leaves its figures out."""
    import json
    import subprocess

    def rows(*extra: str) -> list[dict[str, Any]] | str:
        argv = [binary, "-m", file, "-t", str(threads), "-o", "json", *extra]
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode != 0:
            status = f"signal {-out.returncode}" if out.returncode < 0 else f"exit {out.returncode}"
            tail = out.stderr.strip().splitlines()[-1:] or [""]
            return f"llama-bench failed ({status}) {tail[0]}".strip()
        return list(json.loads(out.stdout))

    gen = rows("-p", "0", "-n", str(tokens), "-r", "3")
    if isinstance(gen, str):
        return gen
    out = {"tg_tok_s": float(next(r["avg_ts"] for r in gen if r["n_gen"] > 0))}
    prompt = rows("-p", "512", "-n", "0", "-r", "3")
    if isinstance(prompt, str):  # (e.g. a prompt path this CPU refuses: the decode figure stands)
        print(f"llama.cpp pp512: no figure: {prompt}")
    else:
        out["pp512_tok_s"] = float(next(r["avg_ts"] for r in prompt if r["n_prompt"] > 0))
    if depths:
        deep = rows("-p", "0", "-n", str(tokens), "-r", "2", "-d", ",".join(map(str, depths)))
        if isinstance(deep, str):  # (a build without -d: the figures above still stand)
            print(f"llama.cpp at depths: no figures: {deep}")
        else:
            out |= {
                f"tg_tok_s@{r['n_depth']}": float(r["avg_ts"]) for r in deep if r.get("n_depth")
            }
    return out


def read_rate_gb_s() -> float:
    """The machine's memory read rate: a 512 MiB float32 tensor summed (best of 3), GB/s."""
    import torch

    big = torch.ones(2**27)
    big.sum()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best / 1e9


def _measure(
    llm: Any, decode_tokens: int, requests: int, quick: bool, depths: tuple[int, ...] = ()
) -> dict[str, float]:
    from engine import SamplingParams

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def decode_rate(prompt: list[int]) -> float:
        m = llm.generate([prompt], greedy(decode_tokens))[0].metrics
        return (decode_tokens - 1) / max(m.finished - m.first_token, 1e-9)

    vocab = int(llm.engine.core.model_info.vocab_size)
    prompt = [(7 * i) % (vocab - 10) + 10 for i in range(64)]
    decode = ttft = 0.0
    for rep in range(1 if quick else 3):
        decode = max(decode, decode_rate([t + rep for t in prompt]))
        long = [(11 * i + rep) % (vocab - 10) + 10 for i in range(64 if quick else 512)]
        first = llm.generate([long], greedy(1))[0].metrics
        ttft = min(ttft or float("inf"), first.first_token - first.arrival)
    at: dict[str, float] = {}  # (after the runs above: the engine is warm)
    for depth in depths:
        context = [[(5 * i + rep) % (vocab - 10) + 10 for i in range(depth)] for rep in range(2)]
        at[f"decode_tok_s@{depth}"] = max(decode_rate(c) for c in context[: 1 if quick else 2])
    prompts = [[(13 * i + j) % (vocab - 10) + 10 for j in range(128)] for i in range(requests)]
    start = time.perf_counter()
    llm.generate(prompts, greedy(8 if quick else 64))
    throughput = requests * (8 if quick else 64) / (time.perf_counter() - start)
    return {"decode_tok_s": decode, "throughput_tok_s": throughput, "ttft_ms": 1000 * ttft, **at}


def run(args: argparse.Namespace) -> int:
    model_path, info = common.begin(
        args, f"GGUF weights kept quantized vs expanded to {args.dtype}"
    )
    from engine import SamplingParams
    from engine.worker.gguf_checkpoint import GGUFCheckpoint, find_gguf, read_config
    from engine.worker.model_loader import resident_weight_bytes
    from engine.worker.models.layers.quantized import GroupedLinear

    file = find_gguf(model_path)
    if file is None:
        print(f"{model_path} is not a GGUF model: pass --model demo-gguf or a .gguf file")
        return 2
    file_bytes = GGUFCheckpoint(file, read_config(file)).tensor_bytes()
    rate = read_rate_gb_s()
    print(f"file tensors {file_bytes / 1e6:.1f} MB; memory read rate {rate:.1f} GB/s")
    requests = 4 if args.quick else args.requests
    decode_tokens = 8 if args.quick else args.decode_tokens
    runs: dict[str, dict[str, float]] = {}
    forced: dict[str, Any] = {}
    seqs: list[list[int]] = []
    starts: list[int] = []
    for mode, (quantization, activations) in MODES.items():
        llm = common.our_llm(model_path, args, quantization=quantization, activations=activations)
        model = llm.engine.core.executor.driver.model
        res = {**_measure(llm, decode_tokens, requests, args.quick, args.depths)}
        res["resident_mb"] = resident_weight_bytes(model) / 1e6
        res["read_limit_fraction"] = res["decode_tok_s"] * res["resident_mb"] / 1e3 / rate
        if mode == "none":  # the reference outputs both engines score
            prompts = [llm.tokenizer.encode(text) for text in AGREEMENT_PROMPTS]
            params = SamplingParams(
                temperature=0.0, max_tokens=8 if args.quick else AGREEMENT_TOKENS, ignore_eos=True
            )
            outs = llm.generate(prompts, params)
            seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)]
            starts = [len(p) for p in prompts]
        with ExitStack() as every_row:  # kept: scored with the decode step's products
            for linear in model.modules():
                if isinstance(linear, GroupedLinear):
                    every_row.enter_context(linear.products_on_every_row())
            forced[mode] = teacher_forced(llm, seqs, starts)
        runs[mode] = res
        print(
            f"quantization={mode}: decode {res['decode_tok_s']:.1f} tok/s "
            f"({100 * res['read_limit_fraction']:.0f}% of the read limit), throughput "
            f"{res['throughput_tok_s']:.1f} tok/s ({requests} requests), TTFT "
            f"{res['ttft_ms']:.1f} ms, weights {res['resident_mb']:.1f} MB"
            + "".join(f", decode at {d} {res[f'decode_tok_s@{d}']:.1f} tok/s" for d in args.depths)
        )
        del llm, model
    dense = runs["none"]
    targets = [t for s, start in zip(seqs, starts, strict=True) for t in s[start:]]
    tf = {mode: compare_forced(forced["none"], forced[mode], targets) for mode in KEPT}
    ratios: dict[str, float] = {}
    for mode in KEPT:
        kept = runs[mode]
        ratios |= {
            f"decode_{mode}": kept["decode_tok_s"] / dense["decode_tok_s"],
            f"throughput_{mode}": kept["throughput_tok_s"] / dense["throughput_tok_s"],
            f"ttft_{mode}": dense["ttft_ms"] / kept["ttft_ms"],
        }
        print(
            f"ratio {KEPT[mode]} / expanded: decode {ratios[f'decode_{mode}']:.2f}x (target >= "
            f"{DECODE_TARGET}x), throughput {ratios[f'throughput_{mode}']:.2f}x (target >= "
            f"{THROUGHPUT_TARGET}x), TTFT {ratios[f'ttft_{mode}']:.2f}x (above 1 is faster); "
            f"teacher-forced agreement with the expanded model "
            f"{100 * tf[mode]['top1_agreement']:.1f}% over {tf[mode]['positions']} positions "
            f"(target >= {100 * AGREEMENT_TARGET:.0f}%)"
        )
    ratios["resident_vs_file"] = runs["gguf"]["resident_mb"] * 1e6 / file_bytes
    print(
        f"resident weights / file tensors: {ratios['resident_vs_file']:.2f}x (target <= "
        f"{RESIDENT_TARGET}x)"
    )
    llama = (
        llama_bench(args.llama_bench, str(file), args.threads, decode_tokens, args.depths)
        if args.llama_bench
        else None
    )
    if isinstance(llama, str):
        print(f"llama.cpp: no figures: {llama}")
    elif llama is not None:
        runs["llama.cpp"] = llama
        prompt = 64 if args.quick else 512  # the TTFT prompt _measure used
        print(
            f"llama.cpp (llama-bench -t {args.threads}): tg{decode_tokens} "
            f"{llama['tg_tok_s']:.1f} tok/s"
            + (f", pp512 {llama['pp512_tok_s']:.1f} tok/s" if "pp512_tok_s" in llama else "")
            + "".join(
                f", tg at {d} {llama[f'tg_tok_s@{d}']:.1f} tok/s"
                for d in args.depths
                if f"tg_tok_s@{d}" in llama
            )
        )
        for mode in KEPT:
            kept = runs[mode]
            decode = ratios[f"decode_vs_llama_cpp_{mode}"] = (
                kept["decode_tok_s"] / llama["tg_tok_s"]
            )
            deep = ""
            if "pp512_tok_s" in llama:
                prefill = prompt / (kept["ttft_ms"] / 1e3) / llama["pp512_tok_s"]
                ratios[f"prefill_vs_llama_cpp_{mode}"] = prefill
                deep += f", prefill {prefill:.2f}x"
            for d in (d for d in args.depths if f"tg_tok_s@{d}" in llama):
                r = ratios[f"decode_vs_llama_cpp_{mode}@{d}"] = (
                    kept[f"decode_tok_s@{d}"] / llama[f"tg_tok_s@{d}"]
                )
                deep += f", decode at {d} {r:.2f}x"
            print(f"deja {KEPT[mode]} / llama.cpp: decode {decode:.2f}x (target >= 1.0x){deep}")
    served = None
    if args.llama_server:
        served = quant_served.compare(args, file, args.dtype)
        ratios["served_vs_llama_cpp"] = served["ratio"]
        quant_served.print_result(served)
    print(report.finish_line(info))
    report.write_json(
        args.json,
        {
            "runs": runs,
            "served": served,
            "ratios": ratios,
            "teacher_forced": tf["gguf"],
            "teacher_forced_int8": tf["gguf-int8"],
            "file_tensor_bytes": file_bytes,
            "read_rate_gb_s": rate,
            "machine": info,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.main("deja bench quant", __doc__, add_arguments, run))
