"""Persistent buffers for a step's flat batch (vLLM V1's InputBatch / CpuGpuBuffer idea).

A step's inputs (token ids, positions, slot mapping, query start locations, sequence lengths,
block tables) are written with numpy into host buffers allocated once and grown only when a step
needs more room; on a CUDA device the host buffers are pinned and each goes to its device twin
with one non-blocking copy. On the CPU the model reads the host buffers themselves (no copy).

NOTE: the tensors `build` returns are views of the persistent buffers: they hold this step's
values until the next `build` overwrites them. The runner and the attention backends use them
within the step only.

Block tables: a row is rewritten only when the list given for it is not the very list that row
was written from last time. The KV manager hands out the same list for a table until the table
changes (`KVCacheManager.block_ids`), so a decode step rewrites only the rows of sequences that
joined, moved to another row, or gained a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.worker.attention.base import AttentionMetadata
from engine.worker.seq_state import SeqState


class _Buffer:
    """One host array (numpy view of a torch tensor, pinned for CUDA) and its device twin."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np = self.cpu.numpy()
        self.dev = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.cpu

    def to_device(self, rows: int) -> torch.Tensor:
        """The first `rows` rows on the device: one non-blocking copy on CUDA, a view on CPU."""
        if self.dev is self.cpu:
            return self.cpu[:rows]
        return self.dev[:rows].copy_(self.cpu[:rows], non_blocking=True)


@dataclass(slots=True)
class StepInputs:
    """What the model reads in one step."""

    input_ids: torch.Tensor
    """[T] int64 token ids of every scheduled token, sequence after sequence."""
    positions: torch.Tensor
    """[T] int64 position of each token in its sequence."""
    meta: AttentionMetadata


class InputBatch:
    """Builds each step's `StepInputs` into buffers that persist across steps."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self._tokens = 0
        self._seqs = 0
        self._blocks = 0
        self._copied: torch.cuda.Event | None = None
        """Recorded after the last step's host-to-device copies (CUDA only)."""
        self._rows: list[list[int] | None] = []
        """The list each block-table row was last written from (kept alive: identity is only
        meaningful while the list lives)."""
        self._alloc(256, 16, 16)

    @staticmethod
    def _decode_ids(
        states: Sequence[SeqState], starts: list[int], dst: list[int], src: list[int]
    ) -> list[int]:
        """A decode step's input ids: each sequence's known token, or 0 where its token is in
        flight (its index goes to `dst`, its row of the in-flight ids to `src`)."""
        out = []
        for i, (state, start) in enumerate(zip(states, starts, strict=True)):
            token_ids = state.token_ids
            if start < len(token_ids):
                out.append(token_ids[start])
            else:
                out.append(0)
                dst.append(i)
                src.append(state.pending_row)
        return out

    def _alloc(self, tokens: int, seqs: int, blocks: int) -> None:
        dev = self.device
        if tokens > self._tokens:
            self.input_ids = _Buffer((tokens,), torch.int64, dev)
            self.positions = _Buffer((tokens,), torch.int64, dev)
            self.slot_mapping = _Buffer((tokens,), torch.int64, dev)
            self._tokens = tokens
        if seqs > self._seqs or blocks > self._blocks:
            seqs, blocks = max(seqs, self._seqs), max(blocks, self._blocks)
            self.query_start_loc = _Buffer((seqs + 1,), torch.int32, dev)
            self.seq_lens = _Buffer((seqs,), torch.int32, dev)
            # block_tables: [seqs, blocks], right-padded with block 0
            self.block_tables = _Buffer((seqs, blocks), torch.int32, dev)
            # async scheduling: flat token index <- row of the in-flight step's sampled ids
            self.gather_dst = _Buffer((seqs,), torch.int64, dev)
            self.gather_src = _Buffer((seqs,), torch.int64, dev)
            self._rows = [None] * seqs
            self._seqs, self._blocks = seqs, blocks

    def build(
        self,
        states: Sequence[SeqState],
        starts: list[int],
        qlens: list[int],
        tables: list[list[int]],
        in_flight: torch.Tensor | None = None,
        drafts: dict[int, list[int]] | None = None,
        token_ids: list[int] | None = None,
    ) -> StepInputs:
        """The flat batch of the sequences `states`, each computing qlens[i] tokens from
        position starts[i], with its block `tables`.

        `in_flight`: the sampled ids [rows] (on the device) of the step still in flight (async
        scheduling). A sequence whose new token is that step's pending sample (its position is
        past its known tokens) takes its input id from row `state.pending_row`, on the device.
        `drafts`: sequence index -> tokens proposed after its last one (speculative decoding):
        they are its input ids after its last token. `token_ids`: a one-token-each step's input
        ids, given (tokens not in the sequences' lists: a draft model's own proposals)."""
        num_seqs, num_tokens = len(states), sum(qlens)
        max_blocks = max(map(len, tables))
        if self._copied is not None:
            # NOTE: the last step may not have synced (no sampling rows, or left in flight by
            # async scheduling): its copies may still read the pinned buffers written below.
            self._copied.synchronize()
        if num_tokens > self._tokens or num_seqs > self._seqs or max_blocks > self._blocks:
            self._alloc(2 * num_tokens, 2 * num_seqs, 2 * max_blocks)
        dst: list[int] = []
        """Flat token indexes whose ids come from `in_flight`, rows `src`."""
        src: list[int] = []
        # NOTE: the scheduler never hands over an item with no new tokens, so T == S means one
        # token per sequence
        if token_ids is not None:
            assert num_tokens == num_seqs == len(token_ids)
            self.input_ids.np[:num_seqs] = token_ids
            seq_idx, seq_lens = self._decode_at(starts)
        elif num_tokens == num_seqs:
            seq_idx, seq_lens = self._decode(states, starts, in_flight, dst, src)
        else:
            seq_idx, seq_lens = self._mixed(states, starts, qlens, dst, src, drafts)
        self.seq_lens.np[:num_seqs] = seq_lens
        self._write_tables(tables)
        # slot = block_id * block_size + offset within the block
        p = self.positions.np[:num_tokens]
        bs = self.block_size
        bt = self.block_tables.np
        self.slot_mapping.np[:num_tokens] = bt[seq_idx, p // bs].astype(np.int64) * bs + p % bs
        seq_lens_list = seq_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping.to_device(num_tokens),
            query_start_loc=self.query_start_loc.to_device(num_seqs + 1),
            seq_lens=self.seq_lens.to_device(num_seqs),
            # whole rows (contiguous, as the CUDA kernels read them): width >= max_blocks
            block_tables=self.block_tables.to_device(num_seqs),
            query_lens_cpu=qlens,
            seq_lens_cpu=seq_lens_list,
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens_list),
        )
        input_ids = self.input_ids.to_device(num_tokens)
        if dst:
            assert in_flight is not None, "a token in flight without the step that samples it"
            self._gather_in_flight(input_ids, in_flight, dst, src)
        step = StepInputs(input_ids, self.positions.to_device(num_tokens), meta)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return step

    def _decode(
        self,
        states: Sequence[SeqState],
        starts: list[int],
        in_flight: torch.Tensor | None,
        dst: list[int],
        src: list[int],
    ) -> tuple[np.ndarray, np.ndarray]:
        """A decode-only step's ids, positions and query starts; (token -> sequence, lengths)."""
        num_seqs = len(states)
        ids = self.input_ids.np
        if in_flight is None:
            ids[:num_seqs] = [st.token_ids[s] for st, s in zip(states, starts, strict=True)]
        else:
            ids[:num_seqs] = self._decode_ids(states, starts, dst, src)
        return self._decode_at(starts)

    def _decode_at(self, starts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """A decode-only step's positions and query starts (its ids written)."""
        num_seqs = len(starts)
        starts_np = np.fromiter(starts, np.int64, num_seqs)
        self.positions.np[:num_seqs] = starts_np
        self.query_start_loc.np[: num_seqs + 1] = np.arange(num_seqs + 1)
        return np.arange(num_seqs), starts_np + 1

    def _mixed(
        self,
        states: Sequence[SeqState],
        starts: list[int],
        qlens: list[int],
        dst: list[int],
        src: list[int],
        drafts: dict[int, list[int]] | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """A step with prefill chunks or proposals: ids, positions and query starts; (token ->
        sequence, lengths)."""
        ids, num_seqs = self.input_ids.np, len(states)
        t = 0
        for i, (state, s, n) in enumerate(zip(states, starts, qlens, strict=True)):
            token_ids = state.token_ids
            proposed = drafts.get(i) if drafts else None
            if proposed:  # its last token, then the proposal
                ids[t : t + n] = token_ids[s:] + proposed
            elif s + n > len(token_ids):  # a decode of the token in flight
                ids[t] = 0
                dst.append(t)
                src.append(state.pending_row)
            else:
                ids[t : t + n] = token_ids[s : s + n]
            t += n
        starts_np = np.fromiter(starts, np.int64, num_seqs)
        qlens_np = np.fromiter(qlens, np.int64, num_seqs)
        seq_idx = np.repeat(np.arange(num_seqs), qlens_np)
        ends = np.cumsum(qlens_np)
        # position of token t = its sequence's start + its offset in the chunk
        first = ends - qlens_np  # [S] flat index of each sequence's first token
        self.positions.np[:t] = np.arange(t) - first[seq_idx] + starts_np[seq_idx]
        qsl = self.query_start_loc.np
        qsl[0] = 0
        qsl[1 : num_seqs + 1] = ends
        return seq_idx, starts_np + qlens_np

    def _write_tables(self, tables: list[list[int]]) -> None:
        """Rewrites the block-table rows whose list is not the one they were written from."""
        bt = self.block_tables.np
        rows = self._rows
        for i, table in enumerate(tables):
            old = rows[i]
            if table is old:
                continue
            n = len(table)
            bt[i, :n] = table
            if old is not None and len(old) > n:
                bt[i, n : len(old)] = 0
            rows[i] = table

    def _gather_in_flight(
        self, input_ids: torch.Tensor, in_flight: torch.Tensor, dst: list[int], src: list[int]
    ) -> None:
        """input_ids[dst] = in_flight[src], on the device (the tokens still in flight)."""
        k = len(dst)
        self.gather_dst.np[:k] = dst
        self.gather_src.np[:k] = src
        gathered = in_flight.index_select(0, self.gather_src.to_device(k))
        input_ids.index_copy_(0, self.gather_dst.to_device(k), gathered)
