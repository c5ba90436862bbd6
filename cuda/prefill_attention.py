"""Loader of prefill_attention.cu: causal attention of a varlen batch over the paged cache.

Handles any mix of query lengths (a decode token is a query of length 1), so it also serves mixed
prefill + decode batches.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cuda.cupy_launch import (
    DTYPE_NAMES,
    FP8,
    LOG2E,
    AttentionArgs,
    AttentionDims,
    attention_configs,
    cache_name,
    check,
    check_aligned,
    check_attention_args,
    check_contiguous,
    check_cuda,
    check_options,
    check_tensor,
    launch,
    ptr,
    soft_cap_log2,
)

CU_FILE = "prefill_attention.cu"
THREADS = 128


def rows_per_tile(dtype: torch.dtype) -> int:
    """Packed (token, head) rows per CTA: PrefillTile<T>::M in prefill_attention.cu."""
    return 32 if dtype == torch.float32 else 64


def kernel_name(
    dtype: torch.dtype, head_dim: int, block_size: int, cache_dtype: torch.dtype | None = None
) -> str:
    """cache_dtype: the KV cache's (None: dtype's own, or FP8)."""
    c = cache_name(dtype, cache_dtype or dtype)
    return f"deja::paged_prefill_kernel<{DTYPE_NAMES[dtype]}, {c}, {head_dim}, {block_size}>"


def instantiations() -> list[str]:
    """Every name expression this loader may compile (the CI compile check builds them all)."""
    return [kernel_name(t, d, b, c) for t, d, b in attention_configs() for c in (t, FP8)]


def paged_prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves.

    out, q: [T, Hq, D], dense in the last two dims, 16-byte aligned rows; tokens outside every
    sequence's [query_start_loc[s], query_start_loc[s + 1]) range are left untouched in out.
    kv_cache: [2, num_blocks, block_size, Hkv, D] contiguous (one layer), already holding the new
    tokens' K/V; or float8_e4m3fn holding K / kv_scales[0] and V / kv_scales[1]. block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32;
    query_start_loc: [num_seqs + 1] int32. max_query_len: host-side upper bound of query lengths.
    sliding_window: a token at p sees keys (p - W, p] only (None: all up to p); blocks before a
    tile's first window are not read. logits_soft_cap: scores become cap * tanh(scores / cap).
    """
    args = AttentionArgs(out, q, kv_cache, block_tables, seq_lens)
    dims = _check_prefill_args(args, query_start_loc, max_query_len)
    check_options(sliding_window, logits_soft_cap)
    num_seqs = seq_lens.shape[0]
    device = check_cuda(**args._asdict(), query_start_loc=query_start_loc)
    if num_seqs == 0 or max_query_len == 0:
        return

    group = dims.num_heads // dims.num_kv_heads
    tiles = math.ceil(max_query_len * group / rows_per_tile(q.dtype))
    launch(
        CU_FILE,
        kernel_name(q.dtype, dims.head_dim, dims.block_size, kv_cache.dtype),
        device,
        grid=(tiles, num_seqs, dims.num_kv_heads),
        block=(THREADS, 1, 1),
        args=(
            ptr(out),
            *args.cache_pointers(),
            ptr(query_start_loc),
            *args.layout(),
            # The K scale folds into the softmax scale: scores are q . k_true * scale * log2(e)
            # before the soft cap, whatever the cache type.
            np.float32(scale * LOG2E * kv_scales[0]),
            np.int32(sliding_window or 0),
            soft_cap_log2(logits_soft_cap),
            np.float32(kv_scales[1]),
        ),
    )


def _check_prefill_args(
    args: AttentionArgs, query_start_loc: torch.Tensor, max_query_len: int
) -> AttentionDims:
    """The shared attention checks plus prefill's own."""
    dims = check_attention_args(args)
    out, q, block_tables = args.out, args.q, args.block_tables
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    num_seqs = args.seq_lens.shape[0]
    check(
        block_tables.shape[0] == num_seqs and query_start_loc.shape[0] == num_seqs + 1,
        lambda: (
            f"block_tables {tuple(block_tables.shape)} and query_start_loc "
            f"{tuple(query_start_loc.shape)} must match {num_seqs} sequences"
        ),
    )
    check(max_query_len >= 0, lambda: f"max_query_len must be >= 0, got {max_query_len}")
    check_aligned("out", out, out.stride(0), nbytes=8 if q.dtype == torch.float32 else 4)
    check_contiguous("query_start_loc", query_start_loc)
    return dims
