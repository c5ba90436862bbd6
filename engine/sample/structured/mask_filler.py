"""Fills each step's token mask on a worker thread while the step's forward pass runs (as vLLM).

Per step, on the step-loop thread:

    pending = filler.start(matchers, filters)   plans the rows, hands the fill to the worker
    hidden = model(...)                         the forward runs meanwhile
    mask = pending.result()                     waits (usually already done), wraps the buffers

The worker runs xgrammar's fill (C++; it releases the GIL), ANDs each row's static token filter,
copies rows that share a matcher and, for a CPU sampler, unpacks the rows into a mask of banned
tokens. It touches numpy arrays only: every torch op stays on the step-loop thread.

Contracts:
- Between `start` and `result` (or `wait`) the caller leaves the matchers alone (no accept).
- Only constrained rows (a matcher) get a mask row; a matcher in several rows (a request's n
  samples before they fork) is filled once and copied.
- The packed buffer is reused: a mask is valid until the next `start`. That is safe on a GPU too:
  the copy of pageable host memory to the device has read it by the time it returns.
- A sample verifying k proposed tokens (speculative decoding) has k + 1 consecutive rows: row j
  is its matcher's mask after the first j proposed tokens, which the worker accepts one by one
  and rolls back afterwards (the core checked beforehand that the grammar accepts them all).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.sample.structured.bitmask import TokenMask, bitmask_words, unpack_banned

if TYPE_CHECKING:
    import xgrammar as xgr


class PendingMask:
    """One step's mask being filled on the worker."""

    def __init__(
        self, future: Future[np.ndarray | None], rows: torch.Tensor | None, packed: torch.Tensor
    ) -> None:
        self._future = future
        self._rows = rows
        self._packed = packed

    def result(self) -> TokenMask:
        """Waits for the fill (re-raising its error) and returns the mask."""
        banned = self._future.result()
        return TokenMask(
            rows=self._rows,
            packed=self._packed,
            banned=None if banned is None else torch.from_numpy(banned).view(torch.bool),
        )

    def wait(self) -> None:
        """Waits for the worker to leave the buffer, ignoring its outcome (error paths)."""
        wait([self._future])


class TokenMaskFiller:
    """Per-engine: the packed mask buffer and the worker thread that fills it."""

    def __init__(self, vocab_size: int, *, unpack_on_host: bool) -> None:
        self.words = bitmask_words(vocab_size)
        self.unpack_on_host = unpack_on_host
        """True for a CPU sampler: the worker also unpacks the bits (off the step thread)."""
        self._packed = np.empty((0, self.words), dtype=np.int32)
        self._packed_t = torch.from_numpy(self._packed)
        """The same memory as a tensor."""
        self._executor: ThreadPoolExecutor | None = None
        self._batch: Any = None
        """xgrammar's BatchGrammarMatcher, built and used on the worker only."""

    def start(
        self,
        matchers: Sequence[xgr.GrammarMatcher | None],
        filters: Sequence[np.ndarray | None],
        proposals: dict[int, Sequence[int]] | None = None,
    ) -> PendingMask | None:
        """Starts filling the mask of a batch whose row i has `matchers[i]` (None: free row)
        and the static token filter `filters[i]` ([W] int32 ANDed into the row, or None).
        `proposals`: first row -> the k tokens proposed to a sample whose k + 1 rows from there
        verify them (the same matcher in each).

        None when no row is constrained.
        """
        proposals = proposals or {}
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        num = len(rows)
        if num > self._packed.shape[0]:
            self._packed = np.empty((max(num, 2 * self._packed.shape[0]), self.words), np.int32)
            self._packed_t = torch.from_numpy(self._packed)
        # In mask-row coordinates (r indexes `rows`).
        first: dict[int, int] = {}
        fill: list[xgr.GrammarMatcher] = []
        fill_rows: list[int] = []
        copies: list[tuple[int, int]] = []  # (dst, src)
        groups: dict[int, tuple[np.ndarray, list[int]]] = {}  # id(filter) -> (filter, rows)
        verify: list[tuple[xgr.GrammarMatcher, int, Sequence[int]]] = []
        skip = 0
        for r, i in enumerate(rows):
            m = matchers[i]
            f = filters[i]
            if f is not None:
                groups.setdefault(id(f), (f, []))[1].append(r)
            if skip:  # a later row of a proposal: filled with its first row
                skip -= 1
                continue
            if i in proposals:
                verify.append((m, r, proposals[i]))  # type: ignore[arg-type]
                skip = len(proposals[i])
                continue
            src = first.setdefault(id(m), r)
            if src == r:
                fill.append(m)  # type: ignore[arg-type]
                fill_rows.append(r)
            else:
                copies.append((r, src))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="deja-mask")
        packed = self._packed[:num]
        future = self._executor.submit(
            self._fill, packed, fill, fill_rows, copies, list(groups.values()), verify
        )
        row_index = None if num == len(matchers) else torch.tensor(rows, dtype=torch.int64)
        return PendingMask(future, row_index, self._packed_t[:num])

    # -- worker thread -------------------------------------------------------------------------
    def _fill(
        self,
        packed: np.ndarray,
        fill: list[xgr.GrammarMatcher],
        fill_rows: list[int],
        copies: list[tuple[int, int]],
        groups: list[tuple[np.ndarray, list[int]]],
        verify: list[tuple[xgr.GrammarMatcher, int, Sequence[int]]],
    ) -> np.ndarray | None:
        packed.fill(-1)
        for m, r, tokens in verify:
            m.fill_next_token_bitmask(packed, r)
            for j, t in enumerate(tokens):
                accepted = m.accept_token(t)
                assert accepted, "a proposal the grammar does not accept reached the mask"
                m.fill_next_token_bitmask(packed, r + j + 1)
            m.rollback(len(tokens))
        if len(fill) == 1:
            fill[0].fill_next_token_bitmask(packed, fill_rows[0])
        elif fill:
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher(max_threads=1)
            self._batch.batch_fill_next_token_bitmask(fill, packed, indices=fill_rows)
        for dst, src in copies:
            packed[dst] = packed[src]
        for f, rows in groups:
            packed[rows] &= f[: packed.shape[1]]
        return unpack_banned(packed) if self.unpack_on_host else None

    def close(self) -> None:
        """Stops the worker (a fill in flight finishes first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
