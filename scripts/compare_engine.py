"""Alternates an older commit and the working tree on this machine, in one run, and prints each
figure's median per tree with their ratio (new / old; for milliseconds, old / new: above 1 is
better):

- `deja bench step --model tiny`: batch-1 steps/s, and the core's host ms a step outside the
  forward at batch 1 and 256;
- `deja bench peer --model demo` (deja alone): offline tok/s and batch-1 decode tok/s;
- `deja bench latency --model demo --skip-transformers`: one user over gRPC, the served decode
  tok/s and TTFT.

Each tree runs its own benchmarks' code (a git worktree for the old one); the order of the two
trees flips every repetition (ABBA), since this kind of VM drifts by 10-20% over half an hour.

    .venv/bin/python scripts/compare_engine.py OLD_COMMIT [--reps 3] [--only step,peer,latency]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BENCHES = {
    "step": [
        ("batch-1 steps/s", ["bench", "step", "--model", "tiny", "--batches", "1,256", "--steps", "200"],
         lambda j: 1000.0 / j["results"][0]["ms"]["step"], True),
        ("batch-1 host ms", None, lambda j: j["results"][0]["ms"]["host"], False),
        ("batch-256 host ms", None, lambda j: j["results"][1]["ms"]["host"], False),
    ],
    "peer": [
        ("offline tok/s", ["bench", "peer", "--model", "demo"],
         lambda j: j["deja"]["offline_tok_s"], True),
        ("batch-1 decode tok/s", None, lambda j: j["deja"]["decode_tok_s"], True),
    ],
    "latency": [
        ("served decode tok/s", ["bench", "latency", "--model", "demo", "--skip-transformers",
                                 "--repeats", "5"],
         lambda j: _served(j)["decode_tok_s_p50"], True),
        ("served TTFT ms", None, lambda j: _served(j)["ttft_ms_p50"], False),
    ],
}  # fmt: skip
"""bench -> [(figure, command (first figure of a bench only), reader of its JSON, higher is
better)]."""


def _served(result: dict) -> dict:
    return next(v for k, v in result["results"].items() if k.startswith("served"))


def run_bench(tree: Path, argv: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "service.cli", *argv, "--json", out.name]
        subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", default="step,peer,latency")
    args = parser.parse_args()
    benches = [b for b in args.only.split(",") if b]
    with tempfile.TemporaryDirectory(prefix="deja-old-") as tmp:
        old = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.old],
                       check=True, capture_output=True)  # fmt: skip
        try:
            figures: dict[tuple[str, str], list[float]] = {}
            trees = [(args.old, old), ("working tree", ROOT)]
            for rep in range(args.reps):
                # ABBA: the order flips every rep, so a machine that drifts favours neither tree
                for name, tree in trees if rep % 2 == 0 else trees[::-1]:
                    for bench in benches:
                        spec = BENCHES[bench]
                        result = run_bench(tree, spec[0][1])
                        line = []
                        for figure, _, read, _ in spec:
                            value = float(read(result))
                            figures.setdefault((name, figure), []).append(value)
                            line.append(f"{figure} {value:.3f}")
                        print(f"rep {rep + 1} {name}: {bench}: {', '.join(line)}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                           capture_output=True)  # fmt: skip
    print(f"\nmedians over {args.reps} alternated runs; CPU: {_cpu()}")
    for bench in benches:
        for figure, _, _, higher in BENCHES[bench]:
            a = statistics.median(figures[(args.old, figure)])
            b = statistics.median(figures[("working tree", figure)])
            ratio = b / a if higher else a / b
            print(f"{figure:>22}: {args.old} {a:9.3f}   working tree {b:9.3f}   ratio {ratio:.3f}")
    return 0


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
