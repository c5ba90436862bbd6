"""One paged decode launch (plain and split-K) and one varlen prefill launch, for compute-sanitizer.

    compute-sanitizer --tool memcheck python scripts/gpu_sanitize_case.py decode|prefill
Small shapes (racecheck and memcheck slow kernels down a lot) with ragged lengths, GQA 4, bf16.
"""

from __future__ import annotations

import math
import sys

import torch

from cuda import paged_attention, prefill_attention, reshape_and_cache
from tests.kernel_reference import attention_reference, make_case, tolerance, write_reference


def main(which: str) -> int:
    device = torch.device("cuda", 0)
    scale = 1 / math.sqrt(128)
    if which == "decode":
        contexts = [0, 15, 100, 1300, 2047]
        case = make_case(contexts, [1] * len(contexts), 32, 8, 128, 16, torch.bfloat16, device)
        cache = case.kv_cache.clone()
        reshape_and_cache.reshape_and_cache(case.k, case.v, cache, case.slot_mapping)
        ref = attention_reference(case, write_reference(case), scale)
        for split in (False, True):
            out = torch.full_like(case.q, float("nan"))
            paged_attention.paged_decode_attention(
                out,
                case.q,
                cache,
                case.block_tables,
                case.seq_lens,
                scale,
                case.max_seq_len,
                split=split,
            )
            torch.cuda.synchronize()
            err = (out.double().cpu() - ref).abs().max().item()
            print(f"decode split={split}: max abs err {err:.2e}")
            assert err < tolerance(torch.bfloat16), err
    else:
        contexts, queries = [0, 21, 40, 3, 300], [19, 12, 1, 150, 37]
        case = make_case(
            contexts, queries, 32, 8, 128, 16, torch.bfloat16, device, num_padding_tokens=3
        )
        cache = write_reference(case)
        out = torch.full_like(case.q, float("nan"))
        prefill_attention.paged_prefill_attention(
            out,
            case.q,
            cache,
            case.block_tables,
            case.seq_lens,
            case.query_start_loc,
            scale,
            case.max_query_len,
        )
        torch.cuda.synchronize()
        n = case.num_queries
        err = (out[:n].double().cpu() - attention_reference(case, cache, scale)).abs().max().item()
        print(f"prefill: max abs err {err:.2e}")
        assert err < tolerance(torch.bfloat16), err
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "decode"))
