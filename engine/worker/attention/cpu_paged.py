"""Paged attention in place on the CPU: the C++ kernel of cpu_paged_attention.cpp.

Per layer: `index_copy_` writes the new K/V by slot (as the torch backend), then one kernel call
attends every sequence of the flat batch (decode, prefill, prefill chunks over a cached prefix,
mixed) directly over the paged cache: K/V blocks are read through the block tables where they
are, never gathered into a padded copy, so a cached prefix costs only its new tokens' attention.
The step's work split (sequences x KV heads x query chunks, long decodes split over key blocks)
is planned inside the kernel from the metadata; nothing is built per layer here.

NOTE: prefill chunks go to the kernel too wherever its vector path takes the cache (a float32 or
bfloat16 cache, head dim 64 or 128, AVX2 and FMA at least). There it is faster than gathering the
chunk's K/V for torch's SDPA: on a 2-core Zen 5 EPYC (AVX-512 with BF16), bfloat16, the kernel
attends a 512-token chunk over a 2,048-token cached prefix at ~268 GMAC/s (its many-row path,
attend_item_lanes) where SDPA's flash kernel reaches ~30; on the demo model the time to the first
token of 512 new tokens over a cached 2,048 went 698 -> ~283 ms, of a fresh 512-token prompt
256 -> ~150 ms (float32: ~840 -> 551-589 and ~400 -> 306-341 ms). With the AVX2 builds of both
(the kernel compiled for Zen 3, torch held to AVX2) the kernel was 3-6% ahead before its many-row
path. Elsewhere, the sequences with SDPA_MIN_QUERIES or more new tokens (on layers without a
window or soft cap) go to SDPA, all of them together through the torch backend's batched path
(up to 4 length groups, one gather + one SDPA call each, never a loop over sequences): where the
kernel would take its scalar path (an fp8 cache, another head dim, no AVX2), and with a bfloat16
cache on a CPU with AMX, where SDPA's flash kernel multiplies on AMX tiles (`sdpa_min_queries`;
a choice not measured on such a CPU).
Decode tokens and short chunks, the bulk of a serving step, never leave the cache.

Supported per layer: float32 or bfloat16 queries over a cache of the same dtype or fp8
(float8_e4m3fn, with the layer's scales), head_dim <= 256, block_size <= 64, at most 48 query
heads per KV head, sliding windows, logit soft caps. Anything else goes to the torch reference
backend for that layer, with one warning per reason (`fallback_reasons` lists them).
"""

from __future__ import annotations

import logging

import torch

from engine.worker.attention.base import AttendOptions, AttentionBackend, AttentionMetadata
from engine.worker.attention.kv_quant import KVScales, is_fp8, quantize_fp8
from engine.worker.attention.torch_ref import TorchAttentionBackend
from engine.worker.cpu_features import has_amx_bf16, has_avx2_fma

logger = logging.getLogger(__name__)

SDPA_MIN_QUERIES = 16
"""Where chunks go to SDPA (`sdpa_min_queries`), a sequence with at least this many new tokens (a
prefill chunk) is attended by SDPA over its own K/V (see the module's NOTE); fewer, by the kernel."""
NEVER = 1 << 62
"""A chunk length no step reaches: every sequence attended by the kernel."""
VECTOR_HEAD_DIMS = (64, 128)
"""Head dims the kernel's vector path takes (attend_item_v); others take its scalar path."""
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 64
MAX_GROUP = 48
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def sdpa_min_queries(kv_cache: torch.Tensor) -> int:
    """New tokens from which a sequence goes to SDPA with this cache [.., BS, Hkv, D]:
    SDPA_MIN_QUERIES where the kernel would take its scalar path or where SDPA runs on AMX tiles
    (a bfloat16 cache, so bfloat16 queries, on a CPU with AMX), NEVER otherwise (module NOTE)."""
    vector = (
        kv_cache.dtype in KERNEL_DTYPES
        and kv_cache.shape[-1] in VECTOR_HEAD_DIMS
        and has_avx2_fma()
    )
    amx = kv_cache.dtype == torch.bfloat16 and has_amx_bf16()
    return NEVER if vector and not amx else SDPA_MIN_QUERIES


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
        self._prefill = TorchAttentionBackend()
        """Attends the step's long prefill chunks (see the module's NOTE)."""
        self._prefill_meta: AttentionMetadata | None = None
        """The metadata of just those sequences (None: the step has none)."""
        self._prefill_tokens: slice | torch.Tensor = slice(0)
        """Their tokens in the flat batch: a slice when contiguous, else an index tensor."""
        self.sdpa_min_queries = SDPA_MIN_QUERIES
        """New tokens from which a sequence goes to SDPA (`sdpa_min_queries` of the bound cache)."""

    def bind_kv_cache(self, kv_cache: torch.Tensor, scales: KVScales | None) -> None:
        super().bind_kv_cache(kv_cache, scales)
        self._fallback.bind_kv_cache(kv_cache, scales)
        self._prefill.bind_kv_cache(kv_cache, scales)
        self.sdpa_min_queries = sdpa_min_queries(kv_cache)

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
        bound = self.sdpa_min_queries
        long = (
            [i for i, n in enumerate(meta.query_lens_cpu) if n >= bound]
            if meta.max_query_len >= bound
            else []
        )
        self._kernel_seqs = _EMPTY
        self._prefill_meta = None
        if long:
            self._prefill_meta, self._prefill_tokens = _sub_metadata(meta, long)
            if len(long) == meta.num_seqs:
                self._kernel_seqs = None
            else:
                rest = sorted(set(range(meta.num_seqs)) - set(long))
                self._kernel_seqs = torch.tensor(rest, dtype=torch.int64)
        if self._fallback_in_use:
            self._fallback.prepare(meta)

    def _writes(self, meta: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self._meta is not meta or self._write_slots is None:
            self.prepare(meta)
        assert self._write_slots is not None
        return self._write_tokens, self._write_slots

    def step_slots(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's write slots [T] int64 when the kernel attends every token of it and none is
        padding (a whole step the compiled decoder stack may run); None otherwise."""
        tokens, slots = self._writes(meta)
        if tokens is not None or self._kernel_seqs is not _EMPTY or self._fallback_in_use:
            return None
        return slots

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
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, opts: AttendOptions
    ) -> torch.Tensor:
        scale, sliding_window, logits_soft_cap = opts
        reason = self.unsupported(q, kv_cache)
        if reason is not None:
            if reason not in self.fallback_reasons:
                self.fallback_reasons.add(reason)
                logger.warning("CPU attention kernel: %s; torch attention for it", reason)
            if not self._fallback_in_use:
                self._fallback_in_use = True
                self._fallback.prepare(meta)
            return self._fallback.attend(q, kv_cache, meta, opts)
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
        if plain and self._prefill_meta is not None:
            rows = self._prefill.attend(
                q[self._prefill_tokens], kv_cache, self._prefill_meta, AttendOptions(scale)
            )
            out[self._prefill_tokens] = rows
        return out


_EMPTY = torch.empty(0, dtype=torch.int64)


def _sub_metadata(
    meta: AttentionMetadata, seqs: list[int]
) -> tuple[AttentionMetadata, slice | torch.Tensor]:
    """The metadata of sequences `seqs` alone (their block tables, lengths and slots), and their
    tokens in the flat batch (a slice when they are contiguous, as the scheduler lays prefills)."""
    starts = [0]
    for n in meta.query_lens_cpu:
        starts.append(starts[-1] + n)
    query_lens = [meta.query_lens_cpu[i] for i in seqs]
    seq_lens = [meta.seq_lens_cpu[i] for i in seqs]
    ranges = [(starts[i], starts[i + 1]) for i in seqs]
    tokens: slice | torch.Tensor
    if all(ranges[j][1] == ranges[j + 1][0] for j in range(len(ranges) - 1)):
        tokens = slice(ranges[0][0], ranges[-1][1])
    else:
        tokens = torch.cat([torch.arange(a, b) for a, b in ranges])
    index = torch.tensor(seqs, dtype=torch.int64)
    loc = [0]
    for n in query_lens:
        loc.append(loc[-1] + n)
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[tokens],
        query_start_loc=torch.tensor(loc, dtype=meta.query_start_loc.dtype),
        seq_lens=meta.seq_lens.index_select(0, index),
        block_tables=meta.block_tables.index_select(0, index),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return sub, tokens
