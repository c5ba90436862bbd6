"""Loader of paged_attention.cu: decode attention (one query token per sequence), plain or split-K.

The split-K (partitioned) variant cuts each context into PARTITION_SIZE-token pieces handled by
separate CTAs, then a reduction kernel merges them. It pays off when the plain grid
(num_seqs x num_kv_heads x head chunks CTAs) cannot fill the GPU and contexts are long; see
`use_split_k`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cuda.cupy_launch import (
    DTYPE_NAMES,
    check,
    check_attention_args,
    check_cuda,
    launch,
    num_sms,
    ptr,
)

CU_FILE = "paged_attention.cu"
DTYPES = tuple(DTYPE_NAMES)
HEAD_SIZES = (64, 96, 128)
BLOCK_SIZES = (16, 32)
HEADS_PER_CTA = (8, 4, 2, 1)
"""Query heads one CTA serves (template QH), largest first; one must divide the GQA group."""
PARTITION_SIZE = 512
"""Tokens per split-K partition (a multiple of every block size)."""
THREADS = 128
LOG2E = 1.4426950408889634


def decode_kernel_name(dtype: torch.dtype, head_dim: int, block_size: int, heads: int) -> str:
    return f"deja::paged_decode_kernel<{DTYPE_NAMES[dtype]}, {head_dim}, {block_size}, {heads}>"


def reduce_kernel_name(dtype: torch.dtype, head_dim: int) -> str:
    return f"deja::paged_decode_reduce_kernel<{DTYPE_NAMES[dtype]}, {head_dim}>"


def instantiations() -> list[str]:
    """Every name expression this loader may compile (the CI compile check builds them all)."""
    names = []
    for dtype in DTYPES:
        for d in HEAD_SIZES:
            names.append(reduce_kernel_name(dtype, d))
            for bs in BLOCK_SIZES:
                names += [decode_kernel_name(dtype, d, bs, h) for h in HEADS_PER_CTA]
    return names


def heads_per_cta(group_size: int) -> int:
    """Largest QH in HEADS_PER_CTA dividing the number of query heads per KV head."""
    return next(h for h in HEADS_PER_CTA if group_size % h == 0)


def use_split_k(num_ctas: int, max_seq_len: int, sm_count: int) -> bool:
    """Split when the plain grid gives under two CTAs per SM and a context spans > 2 partitions."""
    return num_ctas < 2 * sm_count and max_seq_len > 2 * PARTITION_SIZE


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    split: bool | None = None,
) -> None:
    """out[s, h] = softmax(scale * q[s, h] . K_s^T) V_s over sequence s's seq_lens[s] cached tokens.

    out, q: [num_seqs, Hq, D], dense in the last two dims, 16-byte aligned rows.
    kv_cache: [2, num_blocks, block_size, Hkv, D] contiguous (one layer), dtype of q.
    block_tables: [num_seqs, max_blocks] int32 contiguous; seq_lens: [num_seqs] int32, each >= 1.
    max_seq_len: host-side upper bound of seq_lens (sizes the split-K grid).
    split: None picks with `use_split_k`; True / False forces the split-K / plain kernel.
    """
    num_heads, head_dim, block_size, num_kv_heads = _check_decode_args(
        out, q, kv_cache, block_tables, seq_lens, max_seq_len
    )
    device = check_cuda(
        out=out, q=q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens
    )
    num_seqs = q.shape[0]
    if num_seqs == 0 or max_seq_len == 0:
        return

    group = num_heads // num_kv_heads
    heads = heads_per_cta(group)
    ctas = num_seqs * num_kv_heads * (group // heads)
    if split is None:
        split = use_split_k(ctas, max_seq_len, num_sms(device))
    num_parts = math.ceil(max_seq_len / PARTITION_SIZE) if split else 1
    check(num_parts <= 65535, f"context too long for split-K: {num_parts} partitions")
    # The plain kernel covers the whole context with one "partition".
    partition_size = PARTITION_SIZE if split else math.ceil(max_seq_len / block_size) * block_size

    part_out, part_max, part_sum = _partials(out, num_parts)
    scale_log2 = np.float32(scale * LOG2E)
    launch(
        CU_FILE,
        decode_kernel_name(q.dtype, head_dim, block_size, heads),
        device,
        grid=(num_kv_heads * (group // heads), num_seqs, num_parts),
        block=(THREADS, 1, 1),
        args=(
            ptr(out),
            ptr(part_out),
            ptr(part_max),
            ptr(part_sum),
            ptr(q),
            ptr(kv_cache[0]),
            ptr(kv_cache[1]),
            ptr(block_tables),
            ptr(seq_lens),
            np.int64(q.stride(0)),
            np.int64(out.stride(0)),
            np.int32(num_heads),
            np.int32(num_kv_heads),
            np.int32(block_tables.shape[1]),
            np.int32(partition_size),
            scale_log2,
        ),
    )
    if num_parts > 1:
        _reduce_partitions(out, part_out, part_max, part_sum, seq_lens, device)


def _reduce_partitions(
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    seq_lens: torch.Tensor,
    device: torch.device,
) -> None:
    """Split-K's second launch: combines each head's partitions into out [S, Hq, D]."""
    num_seqs, num_heads, num_parts, head_dim = part_out.shape
    launch(
        CU_FILE,
        reduce_kernel_name(out.dtype, head_dim),
        device,
        grid=(num_heads, num_seqs, 1),
        block=(THREADS, 1, 1),
        args=(
            ptr(out),
            ptr(part_out),
            ptr(part_max),
            ptr(part_sum),
            ptr(seq_lens),
            np.int64(out.stride(0)),
            np.int32(num_heads),
            np.int32(num_parts),
            np.int32(PARTITION_SIZE),
        ),
    )


def _check_decode_args(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
) -> tuple[int, int, int, int]:
    """The shared attention checks plus decode's own; (Hq, D, block_size, Hkv)."""
    dims = check_attention_args(
        q, out, kv_cache, block_tables, seq_lens, head_sizes=HEAD_SIZES, block_sizes=BLOCK_SIZES
    )
    block_size = dims[2]
    num_seqs = q.shape[0]
    check(
        block_tables.shape[0] == num_seqs and seq_lens.shape[0] == num_seqs,
        f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
        f"must have {num_seqs} rows",
    )
    check(max_seq_len >= 0, f"max_seq_len must be >= 0, got {max_seq_len}")
    check(
        max_seq_len <= block_tables.shape[1] * block_size,
        f"max_seq_len {max_seq_len} exceeds the block tables' "
        f"{block_tables.shape[1]} x {block_size} slots",
    )
    return dims


def _partials(out: torch.Tensor, num_parts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split-K scratch: part_out [S, Hq, P, D], part_max and part_sum [S, Hq, P] (float32); with
    one partition the kernel writes `out` directly and ignores them."""
    if num_parts == 1:
        return out, out, out
    num_seqs, num_heads, head_dim = out.shape
    part_max = torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32, device=out.device)
    part_out = torch.empty(
        (num_seqs, num_heads, num_parts, head_dim), dtype=torch.float32, device=out.device
    )
    return part_out, part_max, torch.empty_like(part_max)
