"""`deja bench tp`: resident memory per rank under tensor parallelism (issue 28, acceptance 2).

Builds once (in the cache dir) a random Llama of ~64M parameters (hidden 512, 8 layers, 8 heads
/ 4 KV heads, intermediate 2048, vocabulary 32000, untied: ~257 MB in float32), then runs the
same short greedy batch with N = 1 and N = 2 (gloo, CPU), each in a fresh process, with the
same KV pool in blocks (each rank of N = 2 holds half of every block: its KV heads). Prints per
process: the runtime before any model (Python, torch), the peak resident set (VmHWM), and the
N = 1 process's weights + KV bytes; the check: every rank's peak minus its runtime is at most
0.6x the N = 1 weights + KV (the raw ratio is printed too). Outputs of N = 1 and N = 2 are
compared token for token.

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

    base = _kib("self", "VmRSS")
    llm = LLM(args.path, dtype="float32", num_device_blocks=args.blocks, cpu_swap_gib=0.0,
              tensor_parallel_size=args.child)  # fmt: skip
    prompts = [[(7 * i + j) % 500 + 10 for j in range(64 + 16 * i)] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    eng = llm.engine
    weights = sum(t.numel() * t.element_size() for t in eng.model.state_dict().values())
    packed = [getattr(m, "weight_packed", None) for m in eng.model.modules()]
    weights += sum(int(t.numel()) * t.element_size() for t in packed if t is not None)
    kv = eng.runner.kv_cache.numel() * eng.runner.kv_cache.element_size()
    ranks: list[dict[str, int | None]] = [
        {"rank": 0, "base_kib": base, "peak_kib": _kib("self", "VmHWM")}
    ]
    if eng.tp is not None:
        ranks += [
            {"rank": r, "base_kib": None, "peak_kib": _kib(pid, "VmHWM")}
            for r, pid in enumerate(eng.tp.pids, 1)
        ]
        eng.runner.close()
    print(json.dumps({"weights": weights, "kv": kv, "ranks": ranks,
                      "tokens": [o.token_ids for o in outs]}))  # fmt: skip
    return 0


def run(args: argparse.Namespace) -> int:
    if args.child:
        return child(args)
    common.setup_torch(1)
    from bench.tiny_models import build_random_llama

    path = (args.cache_dir or common.default_cache_dir()) / "bench-llama-64m-tp"
    if not (path / "config.json").exists():
        build_random_llama(path, SHAPE)
    info = report.machine_info(1)
    report.print_header("deja bench tp: resident memory per rank", str(path), info)
    runs = {}
    for n in (1, 2):
        cmd = [sys.executable, "-m", "bench.tp", "--child", str(n), "--path", str(path),
               "--blocks", str(args.blocks)]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs[n] = json.loads(out.strip().splitlines()[-1])
    one = runs[1]
    budget_kib = (one["weights"] + one["kv"]) / 1024
    base = one["ranks"][0]["base_kib"]
    rows, checks = [], []
    for n, r in runs.items():
        for rank in r["ranks"]:
            rank_base = rank["base_kib"] or runs[n]["ranks"][0]["base_kib"]
            net = rank["peak_kib"] - rank_base
            rows.append((f"N={n} rank {rank['rank']}", rank_base / 1024, rank["peak_kib"] / 1024,
                         net / 1024, net / budget_kib, rank["peak_kib"] / budget_kib))  # fmt: skip
            if n == 2:
                checks.append(report.Check(f"N=2 rank {rank['rank']} (peak - runtime) / N=1 "
                                           "weights+KV", net / budget_kib, f"<= {TARGET}",
                                           net / budget_kib <= TARGET))  # fmt: skip
    print(f"N=1 weights {one['weights'] / 2**20:.0f} MiB + KV {one['kv'] / 2**20:.0f} MiB "
          f"= {budget_kib / 1024:.0f} MiB; runtime before the model {base / 1024:.0f} MiB")  # fmt: skip
    report.print_table(
        ["process", "runtime MiB", "peak RSS MiB", "peak - runtime MiB", "net / N=1 W+KV",
         "peak / N=1 W+KV"], rows, digits=2)  # fmt: skip
    same = runs[1]["tokens"] == runs[2]["tokens"]
    print(f"greedy outputs N=2 vs N=1: {'identical' if same else 'DIFFER'}")
    for check in checks:
        print(check.line())
    report.write_json(args.json, {"machine": info, "runs": runs, "identical": same})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(common.main("deja bench tp", __doc__, add_arguments, run))
