"""`deja bench tp`: resident memory per rank under tensor parallelism.

Builds once (in the cache dir) a random Llama of ~64M parameters (hidden 512, 8 layers, 8 heads
/ 4 KV heads, intermediate 2048, vocabulary 32000, untied: ~257 MB in float32), then runs the
same short greedy batch with N = 1 and N = 2 (gloo, CPU), each in a fresh process, with the
same KV pool in blocks (each rank of N = 2 holds half of every block: its KV heads). Prints per
process its peak resident set (VmHWM, read after the batch) and the N = 1 process's weights + KV:
the bytes of its parameters and packed (oneDNN) weights plus its paged KV cache.

The runtime subtracted from each peak is the peak of the same process (same N, same rank, same
commands) serving a model of almost no weights (hidden 64, 2 layers, vocabulary 512; its weights
+ KV under 1 MiB): Python, torch, transformers and the tokenizer, the attention kernel, gloo,
thread pools. It does not grow with the model (~400 MiB here, of which ~170 MiB is loading the
tokenizer and transformers' modules after `import engine`). The check: every rank's
(peak - runtime) is at most 0.6x the N = 1 weights + KV; the raw peak / (N = 1 weights + KV) is
printed too. Outputs of N = 1 and N = 2 are compared token for token.

    deja bench tp [--blocks 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import common, report

SHAPE: dict[str, Any] = {
    "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000,
    "max_position_embeddings": 2048, "tie_word_embeddings": False,
}  # fmt: skip
RUNTIME_SHAPE: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 2048, "tie_word_embeddings": False,
}  # fmt: skip
RUNTIME_BLOCKS = 64
TARGET = 0.6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--blocks", type=int, default=2048, help="KV pool in blocks of 16")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--path", default="", help=argparse.SUPPRESS)


def _kib(pid: int | str, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def child(args: argparse.Namespace) -> int:
    """One engine in this process; prints one JSON line of its memory figures."""
    from engine import LLM, SamplingParams

    llm = LLM(args.path, dtype="float32", num_device_blocks=args.blocks, cpu_swap_gib=0.0,
              tensor_parallel_size=args.child)  # fmt: skip
    prompts = [[(7 * i + j) % 500 + 10 for j in range(64 + 16 * i)] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    eng = llm.engine
    weights = sum(t.numel() * t.element_size() for t in eng.core.model.state_dict().values())
    packed = [getattr(m, "weight_packed", None) for m in eng.core.model.modules()]
    weights += sum(int(t.numel()) * t.element_size() for t in packed if t is not None)
    kv = eng.core.runner.kv_cache.numel() * eng.core.runner.kv_cache.element_size()
    ranks: list[dict[str, int]] = [{"rank": 0, "peak_kib": _kib("self", "VmHWM")}]
    if eng.core.executor.world > 1:
        ranks += [
            {"rank": r, "peak_kib": _kib(pid, "VmHWM")}
            for r, pid in enumerate(eng.core.executor.pids, 1)
        ]
        eng.core.executor.close()
    print(json.dumps({"weights": weights, "kv": kv, "ranks": ranks,
                      "tokens": [o.token_ids for o in outs]}))  # fmt: skip
    return 0


def run(args: argparse.Namespace) -> int:
    if args.child:
        return child(args)
    common.setup_torch(1)
    from engine.testing.tiny_models import build_random_llama

    cache = args.cache_dir or common.default_cache_dir()
    path, tiny = cache / "bench-llama-64m-tp", cache / "bench-llama-runtime-tp"
    for p, shape in ((path, SHAPE), (tiny, RUNTIME_SHAPE)):
        if not (p / "config.json").exists():
            build_random_llama(p, shape)
    info = report.machine_info(1)
    report.print_header("deja bench tp: resident memory per rank", str(path), info)
    runs: dict[int, Any] = {}
    runtime: dict[int, Any] = {}
    for n in (1, 2):
        for p, blocks, out in ((path, args.blocks, runs), (tiny, RUNTIME_BLOCKS, runtime)):
            cmd = [sys.executable, "-m", "bench.tp", "--child", str(n), "--path", str(p),
                   "--blocks", str(blocks)]  # fmt: skip
            res = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            out[n] = json.loads(res.strip().splitlines()[-1])
    one = runs[1]
    budget_kib = (one["weights"] + one["kv"]) / 1024
    rows, checks = [], []
    for n, r in runs.items():
        for rank in r["ranks"]:
            base = runtime[n]["ranks"][rank["rank"]]["peak_kib"]
            net = rank["peak_kib"] - base
            rows.append((f"N={n} rank {rank['rank']}", base / 1024, rank["peak_kib"] / 1024,
                         net / 1024, net / budget_kib, rank["peak_kib"] / budget_kib))  # fmt: skip
            if n == 2:
                checks.append(report.Check(f"N=2 rank {rank['rank']} (peak - runtime) / N=1 "
                                           "weights+KV", net / budget_kib, f"<= {TARGET}",
                                           net / budget_kib <= TARGET))  # fmt: skip
    tiny_kib = (runtime[1]["weights"] + runtime[1]["kv"]) / 1024
    print(f"N=1 weights {one['weights'] / 2**20:.0f} MiB + KV {one['kv'] / 2**20:.0f} MiB "
          f"= {budget_kib / 1024:.0f} MiB; runtime = peak of the same process on a "
          f"{tiny_kib:.0f} KiB (weights + KV) model")  # fmt: skip
    report.print_table(
        ["process", "runtime MiB", "peak RSS MiB", "peak - runtime MiB", "net / N=1 W+KV",
         "raw peak / N=1 W+KV"], rows, digits=2)  # fmt: skip
    same = runs[1]["tokens"] == runs[2]["tokens"]
    print(f"greedy outputs N=2 vs N=1: {'identical' if same else 'DIFFER'}")
    for check in checks:
        print(check.line())
    report.write_json(
        args.json, {"machine": info, "runs": runs, "runtime": runtime, "identical": same}
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(common.main("deja bench tp", __doc__, add_arguments, run))
