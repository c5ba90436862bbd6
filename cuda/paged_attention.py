"""Loader of paged_attention.cu: decode attention (one query token per sequence), plain or split-K.

The split-K (partitioned) variant cuts each context into PARTITION_SIZE-token pieces handled by
separate CTAs, then a reduction kernel merges them. It pays off when the plain grid
(num_seqs x num_kv_heads x head chunks CTAs) cannot fill the GPU and contexts are long; see
`use_split_k`.

Sliding window W: the query sees the last W positions; partitions start at the block holding the
window's first position, so the grid spans at most W + block_size - 1 tokens however long the
context (`context_span`), and blocks before the window are never read.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from cuda.cupy_launch import (
    ATTENTION_HEAD_SIZES,
    DTYPE_NAMES,
    DTYPES,
    FP8,
    LOG2E,
    AttentionArgs,
    AttentionDims,
    attention_configs,
    cache_name,
    check,
    check_attention_args,
    check_cuda,
    check_options,
    launch,
    num_sms,
    ptr,
    soft_cap_log2,
)

CU_FILE = "paged_attention.cu"
HEADS_PER_CTA = (8, 4, 2, 1)
"""Query heads one CTA serves (template QH), largest first; one must divide the GQA group."""
PARTITION_SIZE = 512
"""Tokens per split-K partition (a multiple of every block size)."""
THREADS = 128


def decode_kernel_name(
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    heads: int,
    cache_dtype: torch.dtype | None = None,
) -> str:
    """cache_dtype: the KV cache's (None: dtype's own, or FP8)."""
    c = cache_name(dtype, cache_dtype or dtype)
    return (
        f"deja::paged_decode_kernel<{DTYPE_NAMES[dtype]}, {c}, {head_dim}, {block_size}, {heads}>"
    )


def reduce_kernel_name(dtype: torch.dtype, head_dim: int) -> str:
    return f"deja::paged_decode_reduce_kernel<{DTYPE_NAMES[dtype]}, {head_dim}>"


def instantiations() -> list[str]:
    """Every name expression this loader may compile (the CI compile check builds them all)."""
    names = [reduce_kernel_name(t, d) for t in DTYPES for d in ATTENTION_HEAD_SIZES]
    for dtype, d, bs in attention_configs():
        for cache in (dtype, FP8):
            names += [decode_kernel_name(dtype, d, bs, h, cache) for h in HEADS_PER_CTA]
    return names


def heads_per_cta(group_size: int) -> int:
    """Largest QH in HEADS_PER_CTA dividing the number of query heads per KV head."""
    return next(h for h in HEADS_PER_CTA if group_size % h == 0)


def ctas_per_seq(num_heads: int, num_kv_heads: int) -> int:
    """CTAs the decode kernel runs per sequence: each KV head's query heads, QH at a time."""
    group = num_heads // num_kv_heads
    return num_kv_heads * (group // heads_per_cta(group))


def context_span(max_seq_len: int, block_size: int, sliding_window: int | None) -> int:
    """Tokens from a sequence's first read block to its end, at most: max_seq_len, or with a
    window at most W + block_size - 1 (the window plus the part of its first block before it)."""
    if sliding_window is None:
        return max_seq_len
    return min(max_seq_len, sliding_window + block_size - 1)


def use_split_k(num_ctas: int, max_seq_len: int, sm_count: int) -> bool:
    """Split when the plain grid gives under two CTAs per SM and a context spans > 2 partitions."""
    return num_ctas < 2 * sm_count and max_seq_len > 2 * PARTITION_SIZE


class _DecodePlan(NamedTuple):
    heads: int  # query heads per CTA (template QH)
    num_parts: int  # partitions per context; 1: the plain kernel
    partition_size: int  # tokens per partition
    grid: tuple[int, int, int]  # (CTAs per sequence, num_seqs, num_parts)


class _Partials(NamedTuple):
    """Split-K scratch (float32); with one partition all three are `out`, which the kernels
    then write directly."""

    part_out: torch.Tensor  # [S, Hq, P, D]
    part_max: torch.Tensor  # [S, Hq, P]
    part_sum: torch.Tensor  # [S, Hq, P]

    def pointers(self) -> tuple[np.uint64, np.uint64, np.uint64]:
        return ptr(self.part_out), ptr(self.part_max), ptr(self.part_sum)


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    split: bool | None = None,
    *,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> None:
    """out[s, h] = softmax(scale * q[s, h] . K_s^T) V_s over sequence s's seq_lens[s] cached tokens.

    out, q: [num_seqs, Hq, D], dense in the last two dims, 16-byte aligned rows.
    kv_cache: [2, num_blocks, block_size, Hkv, D] contiguous (one layer), dtype of q, or
    float8_e4m3fn holding K / kv_scales[0] and V / kv_scales[1].
    block_tables: [num_seqs, max_blocks] int32 contiguous; seq_lens: [num_seqs] int32, each >= 1.
    max_seq_len: host-side upper bound of seq_lens (sizes the split-K grid).
    split: None picks with `use_split_k`; True / False forces the split-K / plain kernel.
    sliding_window: only the last W positions (None: all); logits_soft_cap: scores become
    cap * tanh(scores / cap) before the softmax (None: off).
    """
    args = AttentionArgs(out, q, kv_cache, block_tables, seq_lens)
    dims = _check_decode_args(args, max_seq_len)
    check_options(sliding_window, logits_soft_cap)
    device = check_cuda(**args._asdict())
    if q.shape[0] == 0 or max_seq_len == 0:
        return
    span = context_span(max_seq_len, dims.block_size, sliding_window)
    plan = _plan(dims, q.shape[0], span, split, device)
    partials = _partials(out, plan.num_parts)
    launch(
        CU_FILE,
        decode_kernel_name(q.dtype, dims.head_dim, dims.block_size, plan.heads, kv_cache.dtype),
        device,
        grid=plan.grid,
        block=(THREADS, 1, 1),
        args=(
            ptr(out),
            *partials.pointers(),
            *args.cache_pointers(),
            *args.layout(),
            np.int32(plan.partition_size),
            # The K scale folds into the softmax scale: scores are q . k_true * scale * log2(e)
            # before the soft cap, whatever the cache type.
            np.float32(scale * LOG2E * kv_scales[0]),
            np.int32(sliding_window or 0),
            soft_cap_log2(logits_soft_cap),
            np.float32(kv_scales[1]),
        ),
    )
    if plan.num_parts > 1:
        _reduce_partitions(out, partials, seq_lens, device, sliding_window, dims.block_size)


def _plan(
    dims: AttentionDims, num_seqs: int, max_seq_len: int, split: bool | None, device: torch.device
) -> _DecodePlan:
    """Heads per CTA, split-K or not (`use_split_k` when `split` is None) and the grid.

    max_seq_len: the longest span of tokens a CTA row reads (`context_span`)."""
    heads = heads_per_cta(dims.num_heads // dims.num_kv_heads)
    ctas = ctas_per_seq(dims.num_heads, dims.num_kv_heads)
    if split is None:
        split = use_split_k(num_seqs * ctas, max_seq_len, num_sms(device))
    num_parts = math.ceil(max_seq_len / PARTITION_SIZE) if split else 1
    check(num_parts <= 65535, lambda: f"context too long for split-K: {num_parts} partitions")
    # The plain kernel covers the whole context with one "partition".
    block_size = dims.block_size
    partition_size = PARTITION_SIZE if split else math.ceil(max_seq_len / block_size) * block_size
    return _DecodePlan(heads, num_parts, partition_size, (ctas, num_seqs, num_parts))


def _reduce_partitions(
    out: torch.Tensor,
    partials: _Partials,
    seq_lens: torch.Tensor,
    device: torch.device,
    sliding_window: int | None,
    block_size: int,
) -> None:
    """Split-K's second launch: combines each head's partitions into out [S, Hq, D]."""
    num_seqs, num_heads, num_parts, head_dim = partials.part_out.shape
    launch(
        CU_FILE,
        reduce_kernel_name(out.dtype, head_dim),
        device,
        grid=(num_heads, num_seqs, 1),
        block=(THREADS, 1, 1),
        args=(
            ptr(out),
            *partials.pointers(),
            ptr(seq_lens),
            np.int64(out.stride(0)),
            np.int32(num_heads),
            np.int32(num_parts),
            np.int32(PARTITION_SIZE),
            np.int32(sliding_window or 0),
            np.int32(block_size),
        ),
    )


def _check_decode_args(args: AttentionArgs, max_seq_len: int) -> AttentionDims:
    """The shared attention checks plus decode's own."""
    dims = check_attention_args(args)
    block_tables, seq_lens = args.block_tables, args.seq_lens
    num_seqs = args.q.shape[0]
    check(
        block_tables.shape[0] == num_seqs and seq_lens.shape[0] == num_seqs,
        lambda: (
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
            f"must have {num_seqs} rows"
        ),
    )
    check(max_seq_len >= 0, lambda: f"max_seq_len must be >= 0, got {max_seq_len}")
    check(
        max_seq_len <= block_tables.shape[1] * dims.block_size,
        lambda: (
            f"max_seq_len {max_seq_len} exceeds the block tables' "
            f"{block_tables.shape[1]} x {dims.block_size} slots"
        ),
    )
    return dims


def _partials(out: torch.Tensor, num_parts: int) -> _Partials:
    """Scratch for `num_parts` partitions of `out` [S, Hq, D] (see _Partials)."""
    if num_parts == 1:
        return _Partials(out, out, out)
    num_seqs, num_heads, head_dim = out.shape
    part_max = torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32, device=out.device)
    part_out = torch.empty(
        (num_seqs, num_heads, num_parts, head_dim), dtype=torch.float32, device=out.device
    )
    return _Partials(part_out, part_max, torch.empty_like(part_max))
