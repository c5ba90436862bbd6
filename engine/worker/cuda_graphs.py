"""Decode CUDA graphs: the whole decode forward (every layer and the LM head) captured once per
batch size and replayed for pure-decode steps (vLLM's CUDAGraphRunner idea).

A decode step of a small model on a GPU is host-bound: each layer's eager forward is a dozen
Python-side launches (ours through CuPy, torch's own), ~30 microseconds of host time each, around
a few microseconds of GPU work. A replay launches the whole captured forward with one call.

- Sizes: 1, 2, 4, 8, then every 8 up to the largest (`graph_sizes`); captured largest first, all
  from one memory pool (a smaller graph reuses the larger one's blocks).
- A step of n sequences replays the smallest captured size B >= n. Its inputs are copied into the
  graph's own buffers (token ids, positions, slot mapping, sequence lengths, block-table rows);
  the B - n padding rows get slot -1 (the cache write skips them) and a sequence length of 1 over
  whatever block their row last named, so they read valid blocks and their outputs are dropped.
- The decode kernel is captured in its plain form, sized for max_model_len (its loop stops at each
  sequence's own length, so the size costs nothing). Where the eager path would split the context
  (few sequences, long contexts: `paged_attention.use_split_k`), the step runs eager instead.
- Prefill, mixed and chunked steps, and the families whose forward syncs with the host (mixture of
  experts: the expert counts), always run eager. `enforce_eager` turns the graphs off.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from cuda.cupy_launch import num_sms
from cuda.paged_attention import ctas_per_seq, use_split_k
from engine.worker.attention.base import AttentionBackend, AttentionMetadata
from engine.worker.models.base import num_kv_heads

logger = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 8


def graph_sizes(largest: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, 16, 24, ... up to `largest` (included)."""
    if largest < 1:
        return []
    sizes = [s for s in SMALL_SIZES if s <= largest]
    sizes += list(range(2 * SIZE_STEP, largest + 1, SIZE_STEP))
    if sizes[-1] != largest:
        sizes.append(largest)
    return sizes


def bucket(sizes: list[int], n: int) -> int | None:
    """The smallest size >= n, or None when n is over the largest (sizes ascending)."""
    for s in sizes:
        if s >= n:
            return s
    return None


@dataclass(slots=True)
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    logits: torch.Tensor
    """[B, V] float32: the replay's output (the LM head over every row)."""


class DecodeGraphs:
    """Captured decode forwards of `model` over `kv_cache`, one per batch size.

    `run(input_ids, positions, meta)` replays the graph for a decode-only step (or returns None
    when the step must run eager); the logits it returns are the graph's own buffer, valid until
    the next replay.
    """

    def __init__(
        self,
        model: Any,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,
        block_size: int,
        max_model_len: int,
        sizes: list[int],
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.sizes = sorted(sizes)
        self.device = kv_cache.device
        largest = self.sizes[-1]
        width = -(-max_model_len // block_size)
        dev = self.device
        # The graphs' own inputs: every replay reads these addresses.
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((largest, width), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, _Graph] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.replays = 0
        """Steps that replayed a graph so far."""
        cfg = model.config
        self._ctas_per_seq = ctas_per_seq(int(cfg.num_attention_heads), num_kv_heads(cfg))

    # -- capture -------------------------------------------------------------------------------
    def _meta(self, size: int) -> AttentionMetadata:
        """A decode batch of `size` sequences over the graph's buffers, each as long as the model
        allows (so every launch is sized for the longest context)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        meta = self._meta(size)
        self.backend.prepare(meta)
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, meta)
        logits: torch.Tensor = self.model.compute_logits(hidden)
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first, into one memory pool; logs time and memory.

        The slot mapping is all padding (-1) while capturing, so the warm-up runs write no KV."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        prev = getattr(self.backend, "decode_split", None)
        self.backend.decode_split = False  # type: ignore[attr-defined]
        try:
            # Warm-up (eager) on the capture stream: compiles the kernels, sizes cuBLAS's
            # workspaces, outside any capture.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for size in {self.sizes[-1], self.sizes[0]}:
                    self._forward(size)
            stream.synchronize()
            for size in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._forward(size)
                self.graphs[size] = _Graph(graph, logits)
            torch.cuda.synchronize(self.device)
        finally:
            self.backend.decode_split = prev  # type: ignore[attr-defined]
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info(
            "captured decode CUDA graphs for %d batch sizes (1..%d) in %.2f s, %.1f MiB",
            len(self.sizes),
            self.sizes[-1],
            self.capture_seconds,
            self.capture_bytes / 2**20,
        )

    # -- replay --------------------------------------------------------------------------------
    def size_for(self, meta: AttentionMetadata, num_tokens: int) -> int | None:
        """The graph size a step replays, or None when it runs eager: not decode-only, more
        sequences than the largest graph, a context past max_model_len, or one the eager path
        would split (split-K) where the captured plain kernel would be slower."""
        n = meta.num_seqs
        if not meta.is_decode_only or num_tokens != n or meta.max_seq_len > self.max_model_len:
            return None
        size = bucket(self.sizes, n)
        if size is None:
            return None
        if use_split_k(size * self._ctas_per_seq, meta.max_seq_len, num_sms(self.device)):
            return None
        return size

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Replays the graph for this decode step: logits [n, V] (a view of the graph's output,
        valid until the next replay), or None when the step must run eager (`size_for`)."""
        n = input_ids.shape[0]
        size = self.size_for(meta, n)
        if size is None:
            return None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # A sequence's blocks all fit the graph's width (max_model_len); the step's table may be
        # wider (it grows by doubling), with nothing but padding past that.
        width = min(meta.block_tables.shape[1], self.block_tables.shape[1])
        self.block_tables[:n, :width].copy_(meta.block_tables[:, :width])
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        g = self.graphs[size]
        g.graph.replay()
        self.replays += 1
        return g.logits[:n]
