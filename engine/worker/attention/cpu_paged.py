"""Paged attention in place on the CPU: the C++ kernel of cpu_paged_attention.cpp.

Per layer: `index_copy_` writes the new K/V by slot (as the torch backend), then one kernel call
attends every sequence of the flat batch (decode, prefill, prefill chunks over a cached prefix,
mixed) directly over the paged cache: K/V blocks are read through the block tables where they
are, never gathered into a padded copy, so a cached prefix costs only its new tokens' attention.
The step's work split (sequences x KV heads x query chunks, long decodes split over key blocks)
is planned inside the kernel from the metadata; nothing is built per layer here.

NOTE: a sequence with SDPA_MIN_QUERIES or more new tokens (a prefill chunk; on layers without a
window or soft cap) goes to SDPA instead: its own blocks are gathered (its length only, no
padding to other sequences) and SDPA's flash kernel (oneDNN: AVX-512 BF16 / AMX) attends them.
The kernel computes scores as float32 dot products, ~8 GFLOP/s a core, where SDPA reaches ~60
on such chunks; there the copy is O(keys) against O(queries x keys) of attention. Decode tokens
and short chunks, the bulk of a serving step, never leave the cache.

Supported per layer: float32 or bfloat16 queries over a cache of the same dtype or fp8
(float8_e4m3fn, with the layer's scales), head_dim <= 256, block_size <= 64, at most 48 query
heads per KV head, sliding windows, logit soft caps. Anything else goes to the torch reference
backend for that layer, with one warning per reason (`fallback_reasons` lists them).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.worker.attention.base import AttentionBackend, AttentionMetadata
from engine.worker.attention.kv_quant import KVScales, dequantize_fp8, is_fp8, quantize_fp8
from engine.worker.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)

SDPA_MIN_QUERIES = 16
"""A sequence with at least this many new tokens (a prefill chunk) is attended by SDPA over its
own K/V (see the module's docstring); fewer, by the kernel."""
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 64
MAX_GROUP = 48
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class CpuPagedAttentionBackend(AttentionBackend):
    """Paged attention with the C++ CPU kernel; `ops` is `load_kernel().ops`."""

    name = "cpu"
    supports_fp8_kv = True

    def __init__(self, ops: object) -> None:
        self._ops = ops
        self._fallback = TorchAttentionBackend()
        self._fallback_in_use = False
        self.fallback_reasons: set[str] = set()
        """Why layers went to the torch backend (each logged once)."""
        self._meta: AttentionMetadata | None = None
        self._write_tokens: torch.Tensor | None = None
        self._write_slots: torch.Tensor | None = None
        self._kernel_seqs: torch.Tensor | None = None
        """[S'] int64: the sequences the kernel attends (empty: all; None: none)."""
        self._sdpa_seqs: list[tuple[int, int, int, int]] = []
        """(sequence, first token, new tokens, sequence length) of those SDPA attends."""
        self._masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        """The step's SDPA masks (see `_sdpa_one`)."""

    def bind_kv_cache(self, kv_cache: torch.Tensor, scales: KVScales | None) -> None:
        super().bind_kv_cache(kv_cache, scales)
        self._fallback.bind_kv_cache(kv_cache, scales)

    def prepare(self, meta: AttentionMetadata) -> None:
        """The step's write slots (one host check for padding slots); the fallback's plan only
        when some layer uses it."""
        slots = meta.slot_mapping.to(torch.int64)
        valid = slots >= 0
        if bool(valid.all()):
            self._write_tokens, self._write_slots = None, slots
        else:
            self._write_tokens = valid.nonzero().squeeze(1)
            self._write_slots = slots[self._write_tokens]
        self._meta = meta
        self._masks = {}
        starts = [0]
        for n in meta.query_lens_cpu:
            starts.append(starts[-1] + n)
        lens = zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        self._sdpa_seqs = [
            (i, starts[i], n, seq_len)
            for i, (n, seq_len) in enumerate(lens)
            if n >= SDPA_MIN_QUERIES
        ]
        self._kernel_seqs = _EMPTY
        if len(self._sdpa_seqs) == meta.num_seqs:
            self._kernel_seqs = None
        elif self._sdpa_seqs:
            long = {i for i, *_ in self._sdpa_seqs}
            rest = [i for i in range(meta.num_seqs) if i not in long]
            self._kernel_seqs = torch.tensor(rest, dtype=torch.int64)
        if self._fallback_in_use:
            self._fallback.prepare(meta)

    def _writes(self, meta: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self._meta is not meta or self._write_slots is None:
            self.prepare(meta)
        assert self._write_slots is not None
        return self._write_tokens, self._write_slots

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        tokens, slots = self._writes(meta)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        cache = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, NB * BS, Hkv, D]
        scales = self.layer_scales(kv_cache) if is_fp8(kv_cache) else None
        for i, new in enumerate((k, v)):  # [T, Hkv, D] each
            if tokens is not None:
                new = new[tokens]
            if scales is None:
                cache[i].index_copy_(0, slots, new.to(cache.dtype))
            else:
                # NOTE: torch has no float8 index_copy_ on the CPU; the bytes are the same.
                codes = quantize_fp8(new, scales[i]).view(torch.uint8)
                cache[i].view(torch.uint8).index_copy_(0, slots, codes)

    def unsupported(self, q: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
        """Why the kernel cannot attend this layer (None: it can)."""
        head_dim, group = q.shape[2], q.shape[1] // kv_cache.shape[3]
        if q.device.type != "cpu":
            return f"device {q.device}"
        if q.dtype not in KERNEL_DTYPES:
            return f"dtype {q.dtype}"
        if kv_cache.dtype != q.dtype and not is_fp8(kv_cache):
            return f"cache dtype {kv_cache.dtype} with {q.dtype} queries"
        if head_dim > MAX_HEAD_DIM or q.stride(2) != 1:
            return f"head_dim {head_dim} (max {MAX_HEAD_DIM}) or strided rows"
        if kv_cache.shape[2] > MAX_BLOCK_SIZE:
            return f"block_size {kv_cache.shape[2]} (max {MAX_BLOCK_SIZE})"
        if group > MAX_GROUP:
            return f"{group} query heads per KV head (max {MAX_GROUP})"
        if not kv_cache.is_contiguous():
            return "a non-contiguous cache view"
        return None

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        self.check_options(sliding_window, logits_soft_cap)
        reason = self.unsupported(q, kv_cache)
        if reason is not None:
            if reason not in self.fallback_reasons:
                self.fallback_reasons.add(reason)
                logger.warning("CPU attention kernel: %s; torch attention for it", reason)
            if not self._fallback_in_use:
                self._fallback_in_use = True
                self._fallback.prepare(meta)
            return self._fallback.attend(
                q,
                kv_cache,
                meta,
                scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
        self._writes(meta)  # the step's split (prepare) for this metadata
        scales = self.layer_scales(kv_cache) if is_fp8(kv_cache) else None
        num_queries = sum(meta.query_lens_cpu)
        out = torch.empty_like(q)  # [T, Hq, D]
        if num_queries < q.shape[0]:
            out[num_queries:] = 0  # padding tokens after the last sequence
        plain = sliding_window is None and logits_soft_cap is None
        kernel_seqs = self._kernel_seqs if plain else _EMPTY
        if kernel_seqs is not None:
            k_scale, v_scale = scales if scales is not None else (1.0, 1.0)
            self._ops.paged_attention(  # type: ignore[attr-defined]
                out,
                q,
                kv_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                kernel_seqs,
                scale,
                sliding_window or 0,
                logits_soft_cap or 0.0,
                k_scale,
                v_scale,
            )
        if plain:
            for seq, start, n, seq_len in self._sdpa_seqs:
                out[start : start + n] = _sdpa_one(
                    q[start : start + n],
                    kv_cache,
                    meta.block_tables[seq],
                    seq_len,
                    scale,
                    scales,
                    self._masks,
                )
        return out


_EMPTY = torch.empty(0, dtype=torch.int64)


def _sdpa_one(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    scale: float,
    kv_scales: tuple[float, float] | None,
    masks: dict[tuple[int, int, torch.dtype], torch.Tensor],
) -> torch.Tensor:
    """One sequence's chunk: q [Q, Hq, D] over its own L = seq_len keys -> [Q, Hq, D].

    kv_cache: [2, NB, BS, Hkv, D]; table: [max_blocks] int32 (its first ceil(L / BS) are read).
    masks: the step's additive masks by (Q, L, dtype), built by the first layer that needs one.
    """
    num_q, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    g = num_q_heads // num_kv_heads
    blocks = table[: -(-seq_len // block_size)].to(torch.int64)
    kv = kv_cache.index_select(1, blocks).flatten(1, 2)[:, :seq_len]  # [2, L, Hkv, D]
    if kv_scales is not None:
        kv = torch.stack([dequantize_fp8(kv[i], q.dtype, kv_scales[i]) for i in (0, 1)])
    k, v = kv.transpose(1, 2).to(q.dtype).unsqueeze(1)  # [1, Hkv, L, D] each
    context = seq_len - num_q
    if context == 0:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True, scale=scale, enable_gqa=True
        )  # [1, Hq, Q, D]
        return out[0].transpose(0, 1)
    # the G query heads of each KV head folded into the query axis: [1, Hkv, G * Q, D]
    queries = q.view(num_q, num_kv_heads, g, head_dim).permute(1, 2, 0, 3)
    queries = queries.reshape(1, num_kv_heads, g * num_q, head_dim)
    mask = masks.get((num_q, seq_len, q.dtype))
    if mask is None:
        # query j (position context + j) sees keys p <= context + j: [1, 1, G * Q, L]
        hidden = torch.arange(seq_len)[None, :] > (torch.arange(num_q) + context)[:, None]
        mask = torch.zeros(num_q, seq_len, dtype=q.dtype).masked_fill_(hidden, float("-inf"))
        mask = mask.repeat(g, 1)[None, None]
        masks[(num_q, seq_len, q.dtype)] = mask
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=scale)
    # [1, Hkv, G * Q, D] -> [Q, Hq, D]
    return out.view(num_kv_heads, g, num_q, head_dim).permute(2, 0, 1, 3).reshape(q.shape)
