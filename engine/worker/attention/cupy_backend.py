"""Attention with deja's own CUDA kernels (cuda/*.cu), compiled by CuPy and run on torch's stream.

Per layer: `reshape_and_cache` writes the new K/V by slot, then
- a decode-only batch (every sequence has exactly one new token) runs the paged decode kernel,
  which picks its split-K variant by itself for few sequences with long contexts;
- any other batch (prefills, prefill chunks over a cached prefix, mixed prefill + decode) runs the
  varlen prefill kernel, which treats a decode token as a query of length 1.
Both take the layer's sliding window (they start reading at the window's first block, so blocks
the KV manager released are never touched) and its logit soft cap.
Supported: float16 / bfloat16 / float32, head_dim 64, 96, 128, block_size 16, 32 (`supports`);
the cache in the same dtype or fp8 (float8_e4m3fn: quantized in reshape_and_cache, read by the
attention kernels with the layer's K scale folded into the softmax scale, so the soft cap sees
the true scores, and the V scale applied to the output).
Other shapes fall back to the torch reference attention (with one warning) unless the backend is
built with fallback=False; block copies are dtype- and shape-agnostic and always use the kernel.
"""

from __future__ import annotations

import logging

import torch

from cuda import block_copy, paged_attention, prefill_attention, reshape_and_cache
from cuda.cupy_launch import (
    ATTENTION_BLOCK_SIZES,
    ATTENTION_HEAD_SIZES,
    attention_supports,
    import_cupy,
)
from engine.worker.attention.base import AttendOptions, AttentionBackend, AttentionMetadata
from engine.worker.attention.kv_quant import KVScales, is_fp8
from engine.worker.attention.torch_ref import TorchAttentionBackend

logger = logging.getLogger(__name__)


def _kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """x if every token row [heads, head_dim] is dense and 16-byte aligned, else a copy."""
    _, heads, head_dim = x.shape
    dense = x.stride(2) == 1 and (heads == 1 or x.stride(1) == head_dim)
    aligned = x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0
    return x if dense and aligned else x.contiguous()


class CupyAttentionBackend(AttentionBackend):
    """Paged attention on CUDA with the kernels of cuda/; needs CUDA and CuPy."""

    name = "cupy"
    supports_fp8_kv = True
    decode_split: bool | None = None
    """The decode kernel's split-K choice: None picks per launch (`use_split_k`); False keeps the
    plain kernel (the CUDA graphs capture it so, engine/worker/cuda_graphs.py)."""

    def __init__(self, device: torch.device | str | None = None, fallback: bool = True) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the cupy attention backend needs a CUDA GPU and none is available; "
                "use attention_backend='torch'"
            )
        dev = torch.device(device if device is not None else "cuda")
        if dev.type != "cuda":
            raise ValueError(f"the cupy attention backend runs on CUDA devices, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        cupy = import_cupy()  # RuntimeError naming the `cuda` extra when CuPy is missing
        if not cupy.cuda.is_available():
            raise RuntimeError("CuPy is installed but sees no CUDA device; use 'torch'")
        self._setup(dev, fallback)

    def _setup(self, device: torch.device, fallback: bool) -> None:
        """State of a constructed backend (tests on CPU build one without the CUDA checks)."""
        self.device = device
        self._fallback = TorchAttentionBackend() if fallback else None
        self._warned = False

    def bind_kv_cache(self, kv_cache: torch.Tensor, scales: KVScales | None) -> None:
        super().bind_kv_cache(kv_cache, scales)
        if self._fallback is not None:
            self._fallback.bind_kv_cache(kv_cache, scales)

    def _scales(self, kv_cache: torch.Tensor) -> tuple[float, float]:
        return self.layer_scales(kv_cache) if is_fp8(kv_cache) else (1.0, 1.0)

    @staticmethod
    def supports(head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
        """Whether the kernels cover this model / cache configuration."""
        return attention_supports(head_dim, block_size, dtype)

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        fallback = self._fallback_for(k, kv_cache)
        if fallback is not None:
            fallback.write_kv(k, v, kv_cache, meta)
            return
        reshape_and_cache.reshape_and_cache(
            _kernel_rows(k), _kernel_rows(v), kv_cache, meta.slot_mapping, *self._scales(kv_cache)
        )

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, opts: AttendOptions
    ) -> torch.Tensor:
        scale, sliding_window, logits_soft_cap = opts
        fallback = self._fallback_for(q, kv_cache)
        if fallback is not None:
            return fallback.attend(q, kv_cache, meta, opts)
        num_tokens, num_heads, head_dim = q.shape
        q = _kernel_rows(q)
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        num_seqs = meta.num_seqs
        num_queries = sum(meta.query_lens_cpu)
        if num_seqs == 0:
            out.zero_()
            return out
        if meta.is_decode_only and num_queries == num_seqs:
            # Sequence i's single token is flat token i (query_start_loc = 0, 1, ..., num_seqs).
            paged_attention.paged_decode_attention(
                out[:num_seqs],
                q[:num_seqs],
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                meta.max_seq_len,
                self.decode_split,
                kv_scales=self._scales(kv_cache),
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
        else:
            prefill_attention.paged_prefill_attention(
                out,
                q,
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                scale,
                meta.max_query_len,
                kv_scales=self._scales(kv_cache),
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
        if num_queries < num_tokens:
            out[num_queries:].zero_()  # padding tokens after the last sequence
        return out

    def _fallback_for(self, x: torch.Tensor, kv_cache: torch.Tensor) -> AttentionBackend | None:
        """None when the kernels cover x: [T, H, D] (q, or k for the cache write) and this cache;
        else the torch fallback (warned once), or ValueError without one."""
        head_dim = x.shape[2]
        if self.supports(head_dim, kv_cache.shape[2], x.dtype):
            return None
        message = (
            f"the CUDA kernels cover head_dim {ATTENTION_HEAD_SIZES}, block_size "
            f"{ATTENTION_BLOCK_SIZES} and float16/bfloat16/float32; got head_dim "
            f"{head_dim}, block_size {kv_cache.shape[2]}, {x.dtype}"
        )
        if self._fallback is None:
            raise ValueError(message)
        if not self._warned:
            logger.warning("%s: using the torch reference attention", message)
            self._warned = True
        return self._fallback

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """One launch for all pairs and layers. NOTE: src and dst must not share block ids."""
        src = src.to(device=kv_cache.device, dtype=torch.int64)
        dst = dst.to(device=kv_cache.device, dtype=torch.int64)
        block_copy.copy_blocks(kv_cache, src.contiguous(), dst.contiguous())
