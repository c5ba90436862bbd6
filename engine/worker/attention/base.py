"""The attention backend interface and the metadata of one flat batch.

KV cache layout (one tensor for the whole model, allocated by the runner):
    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
A layer sees `kv_cache[layer]`: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = K, 1 = V). Slot s lives at block s // block_size, offset s % block_size.
An fp8 cache (float8_e4m3fn, engine/worker/attention/kv_quant.py) holds K / scale and V / scale
with one scale per layer for each; `bind_kv_cache` tells the backend the cache and its scales, and
`layer_scales` finds a layer's pair from the layer's view of the cache (the model passes only the
view, `kv_cache[layer]`).

Flat batch: the scheduled tokens of all sequences are concatenated; sequence i owns tokens
[query_start_loc[i], query_start_loc[i + 1]). Its new tokens sit at positions
[context_len_i, seq_len_i) where context_len_i = seq_len_i - query_len_i tokens are already in
the cache (a cached prefix, earlier prefill chunks or earlier decode steps).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.worker.attention.kv_quant import KVScales, is_fp8


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot for each new token's K/V; a negative slot is padding (skipped)."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32: cumulative query lengths (device)."""
    seq_lens: torch.Tensor
    """[num_seqs] int32: context + new tokens of each sequence after this step (device)."""
    block_tables: torch.Tensor
    """[num_seqs, max_num_blocks] int32: each sequence's block ids, right-padded with 0 (device)."""
    query_lens_cpu: list[int]
    """Host copy of the query lengths (for launch decisions without a device sync)."""
    seq_lens_cpu: list[int]
    """Host copy of seq_lens."""
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence has exactly one new token."""
        return self.max_query_len == 1


class AttendOptions(NamedTuple):
    """One layer's attention settings (None: off; semantics in `AttentionBackend.forward`)."""

    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and attends each sequence over its block table.

    Rules: `forward` writes K/V for every non-padding slot before reading; it never reads or writes
    cache slots outside the block tables and slot mapping it is given; it does not modify q/k/v.
    """

    name: str
    supports_fp8_kv: bool = False
    """Reads and writes a float8_e4m3fn cache (with `bind_kv_cache`'s scales)."""
    _layer_scales: dict[int, tuple[float, float]] | None = None
    """data_ptr of kv_cache[layer] -> (K scale, V scale) of a bound fp8 cache."""
    _layer_index: dict[int, int] | None = None
    """data_ptr of kv_cache[layer] -> layer, of the bound cache."""
    kv_observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
    """Called as (layer, k, v) before each layer's write (KV-scale calibration); None: off."""

    def bind_kv_cache(self, kv_cache: torch.Tensor, scales: KVScales | None) -> None:
        """Tells the backend the whole cache [num_layers, 2, NB, BS, Hkv, D] and, for an fp8
        cache, its per-layer scales. The runner calls it once, after allocating the cache."""
        num_layers = kv_cache.shape[0]
        self._layer_index = {kv_cache[i].data_ptr(): i for i in range(num_layers)}
        if not is_fp8(kv_cache):
            self._layer_scales = None
            return
        if scales is None or scales.num_layers != num_layers:
            raise ValueError(
                f"an fp8 KV cache of {num_layers} layers needs K and V scales for each layer, "
                f"got {scales!r}"
            )
        self._layer_scales = {
            kv_cache[i].data_ptr(): (scales.k[i], scales.v[i]) for i in range(num_layers)
        }

    def layer_of(self, kv_cache: torch.Tensor) -> int:
        """The layer whose view kv_cache ([2, NB, BS, Hkv, D]) is, of the bound cache."""
        layer = None if self._layer_index is None else self._layer_index.get(kv_cache.data_ptr())
        if layer is None:
            raise ValueError(
                "this KV cache view is not a layer of the cache given to bind_kv_cache"
            )
        return layer

    def layer_scales(self, kv_cache: torch.Tensor) -> tuple[float, float]:
        """(K scale, V scale) of the fp8 layer view kv_cache: [2, NB, BS, Hkv, D]."""
        pair = None if self._layer_scales is None else self._layer_scales.get(kv_cache.data_ptr())
        if pair is None:
            raise ValueError(
                "an fp8 KV cache layer without scales: call bind_kv_cache(kv_cache, scales) "
                "with the cache the model is given"
            )
        return pair

    @staticmethod
    def supports(head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
        """Whether the backend's own kernels cover this configuration (without falling back)."""
        return True

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 (optional hook)
        """Builds what every layer of this step shares from `meta` (index tensors, buffers).

        The runner calls it once per step, after the metadata is final and before the forward
        pass; a backend that needs nothing per step keeps this no-op.
        """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D], kv_cache: [2, NB, BS, Hkv, D] -> out [T, Hq, D].

        Each new token attends causally: to its sequence's cached context and to the new tokens
        at or before its own position. Hq is a multiple of Hkv (grouped-query attention).
        `write_kv` runs first, then `attend`.

        Per-layer options (None: off), with transformers' semantics:
        - sliding_window W: the query at position p sees key position k iff p - W < k <= p (the
          last W positions, its own included). Block table entries before p - W + 1 may be
          placeholders for blocks the KV manager released: they are never read (or masked).
        - logits_soft_cap c: scores = c * tanh(scores / c) on the scaled scores, before masking
          and softmax (Gemma 2's attn_logit_softcapping). With an fp8 cache the scores are
          q . k * scale on the dequantized K (the K scale applied before the cap).
        """
        if self.kv_observer is not None:
            self.kv_observer(self.layer_of(kv_cache), k, v)
        self.check_options(sliding_window, logits_soft_cap)
        self.write_kv(k, v, kv_cache, meta)
        return self.attend(q, kv_cache, meta, AttendOptions(scale, sliding_window, logits_soft_cap))

    @abstractmethod
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Writes the new K/V (k/v: [T, Hkv, D]) into their slots of kv_cache: [2, NB, BS, Hkv, D];
        padding tokens (negative slots) are skipped."""

    @abstractmethod
    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, opts: AttendOptions
    ) -> torch.Tensor:
        """q: [T, Hq, D] over kv_cache (new K/V already written) -> out [T, Hq, D]; padding
        tokens after the last sequence get zeros. `opts` (checked) as in `forward`."""

    @staticmethod
    def check_options(sliding_window: int | None, logits_soft_cap: float | None) -> None:
        """ValueError on a window < 1 or a soft cap <= 0."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")

    def copy_blocks(self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies whole blocks src[i] -> dst[i] in every layer (copy-on-write, swaps).

        kv_cache: [num_layers, 2, NB, BS, Hkv, D]; src/dst: [n] int64 on kv_cache's device.
        Dtype-agnostic: fp8 blocks move as they are, their scales are per layer.
        """
        kv_cache[:, :, dst] = kv_cache[:, :, src]
