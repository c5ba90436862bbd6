"""One paged decode launch (plain and split-K) and one varlen prefill launch, for compute-sanitizer;
or `graph`: a tiny engine whose decode steps replay CUDA graphs (padded sizes included);
`graph-cpu`: the same engine run on the CPU (no graphs there), the dry run's check of the script.

    compute-sanitizer --tool memcheck python scripts/gpu_sanitize_case.py decode|prefill|graph
Small shapes (racecheck and memcheck slow kernels down a lot) with ragged lengths, GQA 4, bf16.
"""

from __future__ import annotations

import math
import sys

import torch

from cuda import reshape_and_cache
from tests.support import kernel_reference as kref


def graph_replays(device: str = "cuda") -> int:
    """Six ragged requests on a tiny bf16 Llama (head_dim 64): decode steps of 6 down to 1
    sequences replay the graphs of sizes 8, 4, 2 and 1 (padding rows included)."""
    import tempfile

    from engine import LLM, SamplingParams
    from engine.testing.tiny_models import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_llama(tmp, hidden_size=256, num_attention_heads=4)
        backend = "cupy" if device == "cuda" else "auto"
        llm = LLM(model=str(path), device=device, attention_backend=backend, dtype="bfloat16",
                  num_device_blocks=128, max_num_seqs=8)  # fmt: skip
        prompts = [[10 + i] * (5 + 37 * i) for i in range(6)]
        params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
                  for i in range(6)]  # fmt: skip
        llm.generate(prompts, params)
        graphs = llm.engine.core.runner.graphs
        if device == "cuda":
            assert graphs is not None and graphs.replays > 0
            print(f"graph: {graphs.replays} decode steps replayed a CUDA graph")
        llm.engine.close()
    return 0


def main(which: str) -> int:
    if which in ("graph", "graph-cpu"):
        return graph_replays("cuda" if which == "graph" else "cpu")
    device = torch.device("cuda", 0)
    scale = 1 / math.sqrt(128)
    if which == "decode":
        contexts = [0, 15, 100, 1300, 2047]
        case = kref.make_case(contexts, [1] * len(contexts), 32, 8, 128, 16, torch.bfloat16, device)
        cache = case.kv_cache.clone()
        reshape_and_cache.reshape_and_cache(case.k, case.v, cache, case.slot_mapping)
        ref = kref.attention_reference(case, kref.write_reference(case), scale)
        for split in (False, True):
            out = kref.run_decode(case, cache, scale, split)
            torch.cuda.synchronize()
            err = (out.double().cpu() - ref).abs().max().item()
            print(f"decode split={split}: max abs err {err:.2e}")
            assert err < kref.tolerance(torch.bfloat16), err
    else:
        contexts, queries = [0, 21, 40, 3, 300], [19, 12, 1, 150, 37]
        case = kref.make_case(
            contexts, queries, 32, 8, 128, 16, torch.bfloat16, device, num_padding_tokens=3
        )
        cache = kref.write_reference(case)
        out = kref.run_prefill(case, cache, scale)
        torch.cuda.synchronize()
        n = case.num_queries
        ref = kref.attention_reference(case, cache, scale)
        err = (out[:n].double().cpu() - ref).abs().max().item()
        print(f"prefill: max abs err {err:.2e}")
        assert err < kref.tolerance(torch.bfloat16), err
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "decode"))
