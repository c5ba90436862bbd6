"""`deja bench moe`: the batched mixture of experts against a dense model and transformers.

Builds once (in the cache dir) a small random Qwen3-MoE (8 experts, top-2) and a dense Qwen3
with the same active parameters per token: the same attention, and a dense MLP as wide as the
two experts a token runs (2 x the expert width). Then, in one run:
  1. a decode step at batch 64 (`deja bench step`'s measurement: 64 sequences of 32-token
     prompts, pure-decode steps timed one by one, the two models' steps alternated in rounds):
     median MoE step ms / median dense step ms, target <= 1.5x;
  2. offline throughput on the MoE: our engine against transformers `generate` (static batches)
     on the same requests, target >= 2x; greedy outputs are checked for parity on a few.

    deja bench moe [--steps 32] [--rounds 4] [--num-requests 32] [--quick] [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bench import common, report

EXPERTS, TOP_K = 8, 2
SHAPE: dict[str, Any] = {
    "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}  # fmt: skip
EXPERT_WIDTH = 512
STEP_TARGET = 1.5
THROUGHPUT_TARGET = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_common_arguments(parser)
    parser.set_defaults(model="moe")
    parser.add_argument("--batch", type=int, default=64, help="decode batch size")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="MoE and dense timed steps alternated in this many rounds",
    )
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--batch-size", type=int, default=8, help="transformers' static batch")
    common.add_num_requests_argument(parser, full=32, quick=8)


def build_models(cache: Path) -> tuple[str, str]:
    """(MoE folder, dense folder), built once with a fixed seed."""
    from engine.testing.tiny_models import build_tiny_qwen3, build_tiny_qwen3_moe

    moe, dense = cache / "bench-qwen3-moe-8x2", cache / "bench-qwen3-dense-same-active"
    if not (moe / "config.json").exists():
        build_tiny_qwen3_moe(
            moe, intermediate_size=TOP_K * EXPERT_WIDTH, moe_intermediate_size=EXPERT_WIDTH,
            num_experts=EXPERTS, num_experts_per_tok=TOP_K, mlp_only_layers=[], **SHAPE,
        )  # fmt: skip
    if not (dense / "config.json").exists():
        build_tiny_qwen3(dense, intermediate_size=TOP_K * EXPERT_WIDTH, **SHAPE)
    return str(moe), str(dense)


def decode_step_ms(paths: dict[str, str], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """{name: {"step": median step ms, "forward": mean forward ms}} at batch `args.batch`, the
    models' timed steps alternated in `args.rounds` rounds (both engines built and warmed first),
    so a slow spell of a shared machine falls on both alike."""
    from bench.step import StepProbe

    step_args = argparse.Namespace(**{**vars(args), "device": "cpu", "attention_backend": "auto"})
    rounds = max(1, min(args.rounds, args.steps))
    probes = {
        name: StepProbe(path, step_args, args.batch, args.steps) for name, path in paths.items()
    }
    for r in range(rounds):
        count = args.steps // rounds + (r < args.steps % rounds)
        for probe in probes.values():
            probe.time_steps(count)
    out = {}
    for name, probe in probes.items():
        probe.close()
        out[name] = {"step": probe.median_ms("step"), "forward": probe.mean_ms()["forward"]}
    return out


def offline(model_path: str, args: argparse.Namespace) -> dict[str, Any]:
    from bench.hf_baselines import check_parity, load_hf_model, run_hf_generate
    from bench.offline import run_ours

    ids, _ = common.allowed_token_ids(model_path)
    num = args.num_requests or (8 if args.quick else 32)
    requests = common.make_requests(args.seed, ids, num, (32, 256), (16, 64))
    warmup = common.make_requests(args.seed + 1_000_003, ids, 4, (32, 256), (4, 8))
    ours, _ = run_ours(model_path, args, requests, warmup)
    model = load_hf_model(model_path, args.dtype)
    gen = run_hf_generate(model, requests, warmup, args.batch_size)
    parity = check_parity(model, requests, ours.outputs, 2 if args.quick else 4)
    report.print_table(
        ["system", "wall s", "useful out tok", "tok/s"],
        [(r.name, r.seconds, r.useful_tokens, r.tokens_per_s) for r in (ours, gen)],
    )
    return {
        "ours": ours.to_json(),
        "generate": gen.to_json(),
        "ratio": ours.tokens_per_s / gen.tokens_per_s,
        "parity_identical": sum(p["identical"] for p in parity),
        "parity_checked": len(parity),
    }


def run(args: argparse.Namespace) -> int:
    common.setup_torch(args.threads)
    cache = args.cache_dir or common.default_cache_dir()
    moe, dense = build_models(cache)
    info = report.machine_info(args.threads)
    report.print_header("deja bench moe: batched experts vs dense and transformers", moe, info)
    if args.quick:
        args.steps, args.warmup, args.rounds = 8, 4, 2
    print(
        f"MoE: {EXPERTS} experts, top-{TOP_K}, expert width {EXPERT_WIDTH}; dense: MLP width "
        f"{TOP_K * EXPERT_WIDTH} (same active parameters); {SHAPE}; {args.dtype}"
    )
    sys.stdout.flush()
    step = decode_step_ms({"moe": moe, "dense": dense}, args)
    report.print_table(
        ["model", f"decode step ms (batch {args.batch}, median)", "forward ms (mean)"],
        [(name, ms["step"], ms["forward"]) for name, ms in step.items()],
        digits=3,
    )
    step_ratio = step["moe"]["step"] / step["dense"]["step"]
    checks = [report.Check("decode step MoE / dense", step_ratio, f"<= {STEP_TARGET}",
                           step_ratio <= STEP_TARGET)]  # fmt: skip
    print()
    off = offline(moe, args)
    checks.append(report.Check("offline tok/s ours / transformers generate", off["ratio"],
                               f">= {THROUGHPUT_TARGET}", off["ratio"] >= THROUGHPUT_TARGET))  # fmt: skip
    print(
        f"greedy parity with transformers: {off['parity_identical']}/{off['parity_checked']} identical"
    )
    for check in checks:
        print(check.line())
    print(report.finish_line(info))
    payload = {"machine": info, "step_ms": step, "step_ratio": step_ratio, "offline": off}
    report.write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(common.main("deja bench moe", __doc__, add_arguments, run))
