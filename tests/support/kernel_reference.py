"""Naive paged-attention references and random paged batches, for the kernel tests.

Used by tests/gpu (kernels on a GPU) and tests/cuda_emu (the same kernels emulated on the CPU).
The reference loops over sequences in float64: slow, obviously correct.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cuda import paged_attention, prefill_attention

AttnConfig = tuple[torch.dtype, int, int, int, int]
"""(dtype, head_dim, block_size, num_heads, num_kv_heads)"""

# The emulated kernel tests' instantiations (tests/cuda_emu): GQA groups 1, 3, 4, 6, 8, 12 cover
# every heads-per-CTA template (1, 2, 4, 8) and several CTAs per KV head.
ATTN_CONFIGS: list[AttnConfig] = [
    (torch.bfloat16, 128, 16, 8, 2),
    (torch.float16, 96, 32, 8, 1),
    (torch.float32, 64, 16, 2, 2),
    (torch.bfloat16, 64, 32, 6, 1),
    (torch.float32, 128, 32, 12, 1),
    (torch.float16, 64, 16, 6, 2),
    (torch.float32, 96, 16, 4, 1),
]


def config_id(cfg: AttnConfig) -> str:
    dtype, d, bs, hq, hkv = cfg
    return f"{str(dtype).removeprefix('torch.')}-d{d}-bs{bs}-h{hq}/{hkv}"


def attention_kernel_names(
    configs: list[AttnConfig], cache_dtype: torch.dtype | None = None
) -> list[str]:
    """The decode, split-K reduction and prefill kernels of `configs` over a `cache_dtype` cache
    (None: the activations' dtype)."""
    names = []
    for dtype, d, bs, hq, hkv in configs:
        heads = paged_attention.heads_per_cta(hq // hkv)
        names.append(paged_attention.decode_kernel_name(dtype, d, bs, heads, cache_dtype))
        names.append(paged_attention.reduce_kernel_name(dtype, d))
        names.append(prefill_attention.kernel_name(dtype, d, bs, cache_dtype))
    return names


@dataclass
class PagedCase:
    """One random flat batch over a paged cache (one layer)."""

    q: torch.Tensor
    """[T, Hq, D]"""
    k: torch.Tensor
    """[T, Hkv, D]: the new tokens' keys (not yet in the cache)."""
    v: torch.Tensor
    kv_cache: torch.Tensor
    """[2, NB, BS, Hkv, D]: context tokens written, every other slot NaN."""
    slot_mapping: torch.Tensor
    """[T] int64, -1 for padding tokens (after the last sequence)."""
    block_tables: torch.Tensor
    """[S, max_blocks] int32, random distinct blocks, right-padded with random ids."""
    seq_lens: torch.Tensor
    """[S] int32"""
    query_start_loc: torch.Tensor
    """[S + 1] int32"""
    context_lens: list[int]
    query_lens: list[int]

    @property
    def max_seq_len(self) -> int:
        return max(c + q for c, q in zip(self.context_lens, self.query_lens, strict=True))

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def num_queries(self) -> int:
        return sum(self.query_lens)


def make_case(
    context_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    num_padding_tokens: int = 0,
    extra_blocks: int = 3,
    seed: int = 0,
    window: int | None = None,
) -> PagedCase:
    """Random q/k/v and a cache whose unused slots hold NaN (a kernel that reads them fails).

    window: blocks wholly before every new token's sliding window (positions < the block start
    of ctx - window + 1) stay NaN, as a block the KV manager released may hold anything."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 1  # one padding column at least
    tables: list[list[int]] = []
    used = 0
    for n in blocks_per_seq:
        row = perm[used : used + n]
        used += n
        pad = torch.randint(0, num_blocks, (max_blocks - n,), generator=gen).tolist()
        tables.append(row + pad)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    cache = cache.to(dtype)
    flat = cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    for table, ctx in zip(tables, context_lens, strict=True):
        first = 0 if window is None else max(0, ctx - window + 1) // block_size * block_size
        for pos in range(first, ctx):
            slot = table[pos // block_size] * block_size + pos % block_size
            flat[:, slot] = rand(2, num_kv_heads, head_dim)

    slots: list[int] = []
    for table, ctx, qlen in zip(tables, context_lens, query_lens, strict=True):
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + qlen)
        ]
    slots += [-1] * num_padding_tokens
    num_tokens = len(slots)
    starts = [0]
    for qlen in query_lens:
        starts.append(starts[-1] + qlen)
    dev = torch.device(device)
    return PagedCase(
        q=rand(num_tokens, num_heads, head_dim).to(dev),
        k=rand(num_tokens, num_kv_heads, head_dim).to(dev),
        v=rand(num_tokens, num_kv_heads, head_dim).to(dev),
        kv_cache=cache.to(dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        context_lens=list(context_lens),
        query_lens=list(query_lens),
    )


def write_reference(case: PagedCase) -> torch.Tensor:
    """The cache after writing the new tokens' K/V (padding slots skipped)."""
    cache = case.kv_cache.clone()
    flat = cache.view(2, -1, *cache.shape[3:])
    keep = case.slot_mapping >= 0
    flat[0, case.slot_mapping[keep]] = case.k[keep]
    flat[1, case.slot_mapping[keep]] = case.v[keep]
    return cache


def attention_reference(
    case: PagedCase,
    kv_cache: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """[num_queries, Hq, D] float64: causal attention of every new token over its sequence.

    window: the query at p sees keys k with p - window < k <= p; soft_cap: scores become
    soft_cap * tanh(scores / soft_cap) before masking. Keys outside every window are not read
    (their blocks may be placeholders)."""
    block_size = kv_cache.shape[2]
    num_heads = case.q.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:]).double().cpu()
    tables = case.block_tables.cpu().tolist()
    q = case.q.double().cpu()
    outs = []
    start = 0
    for table, ctx, qlen in zip(tables, case.context_lens, case.query_lens, strict=True):
        seq_len = ctx + qlen
        first = 0 if window is None else max(0, ctx - window + 1)  # first key any query sees
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(first, seq_len)]
        )
        k = flat[0, slots].repeat_interleave(group, dim=1)  # [L', Hq, D]
        v = flat[1, slots].repeat_interleave(group, dim=1)
        qs = q[start : start + qlen]  # [Q, Hq, D]
        scores = torch.einsum("qhd,lhd->hql", qs, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        pos = torch.arange(ctx, seq_len)[:, None]  # [Q, 1]
        keys = torch.arange(first, seq_len)[None, :]  # [1, L']
        mask = keys <= pos  # [Q, L']
        if window is not None:
            mask &= keys > pos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hql,lhd->qhd", scores.softmax(-1), v))
        start += qlen
    return torch.cat(outs)


def run_decode(
    case: PagedCase,
    kv_cache: torch.Tensor,
    scale: float,
    split: bool | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """The paged decode kernel over `case` (one query token per sequence), into a NaN-filled out."""
    return _run_kernel(
        paged_attention.paged_decode_attention,
        case,
        kv_cache,
        scale,
        case.max_seq_len,
        split=split,
        sliding_window=window,
        logits_soft_cap=soft_cap,
    )


def run_prefill(
    case: PagedCase,
    kv_cache: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """The varlen prefill kernel over `case`, into a NaN-filled out (padding rows stay NaN)."""
    return _run_kernel(
        prefill_attention.paged_prefill_attention,
        case,
        kv_cache,
        case.query_start_loc,
        scale,
        case.max_query_len,
        sliding_window=window,
        logits_soft_cap=soft_cap,
    )


def _run_kernel(
    kernel: Callable[..., None], case: PagedCase, kv_cache: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """`kernel(out, q, kv_cache, block_tables, seq_lens, *args, **kwargs)` into a NaN-filled out."""
    out = torch.full_like(case.q, float("nan"))
    kernel(out, case.q, kv_cache, case.block_tables, case.seq_lens, *args, **kwargs)
    return out


def assert_matches_reference(
    out: torch.Tensor,
    case: PagedCase,
    kv_cache: torch.Tensor,
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
    context: object = None,
) -> None:
    """`out`'s query rows agree with `attention_reference` within `tolerance(out.dtype)`
    (`kv_cache` in the activations' dtype: dequantize an fp8 cache first)."""
    ref = attention_reference(case, kv_cache, scale, window=window, soft_cap=soft_cap)
    err = (out[: case.num_queries].double() - ref).abs().max().item()
    assert err < tolerance(out.dtype), (context, err)


def tolerance(dtype: torch.dtype) -> float:
    """Max abs error allowed against the float64 reference for unit-variance inputs."""
    return {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
