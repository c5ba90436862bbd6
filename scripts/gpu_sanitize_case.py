"""One paged decode launch (plain and split-K) and one varlen prefill launch, for compute-sanitizer.

    compute-sanitizer --tool memcheck python scripts/gpu_sanitize_case.py decode|prefill
Small shapes (racecheck and memcheck slow kernels down a lot) with ragged lengths, GQA 4, bf16.
"""

from __future__ import annotations

import math
import sys

import torch

from cuda import reshape_and_cache
from tests import kernel_reference as kref


def main(which: str) -> int:
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
