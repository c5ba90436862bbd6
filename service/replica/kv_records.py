"""The replica agent's prefix records from KV events: applied in memory, written in batches.

`KvRecordWriter.apply(batch)` brings the writer's view of what each tier holds in line with one
event batch and does no I/O. A block whose best tier changes (device, then cpu, then disk; none
when no tier holds it) becomes a pending change, netted per block: the last change wins, and a
block back at the tier the store was last given has no change at all. `run()` writes the pending
changes at most every `flush_s` seconds, up to `_MAX_WRITE_BLOCKS` blocks per store call (one
`write_prefixes`: one Redis pipeline), so a burst of engine steps costs one write, not one per
step.

A failed write is kept and retried on a later flush (after `retry_s`, with fewer blocks per call
until one succeeds): no event is lost to the store, so a store failure never needs a fresh
snapshot. `AllBlocksCleared` drops the held blocks and the pending changes and makes the next
flush start with `clear_prefixes`. `refresh()` queues every held block again (the agent calls it
every `prefix_ttl_s / 2`, so live records do not expire). Pending changes stay bounded: past
`max_pending` blocks more than are held, the writer starts over from what it holds (clear, then
record every held block).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import NamedTuple

from engine.kv.events import AllBlocksCleared, BlockStored
from engine.kv.hashing import BlockHash
from service.affinity.base import TIERS, AffinityStore
from service.replica.kv_events import KvBatch

log = logging.getLogger(__name__)

_MEDIUM_BIT = {"device": 1, "cpu": 2, "disk": 4, "remote": 8}
LOCAL_MEDIA = frozenset({"device", "cpu", "disk"})
_MAX_WRITE_BLOCKS = 1024
_MIN_WRITE_BLOCKS = 64
_MAX_PENDING = 65536

Attempt = Callable[[str, Awaitable[None]], Awaitable[bool]]
"""`(op, store call) -> True when it succeeded`; logs and counts a failure (the agent's `_try`)."""


class _Doubt:
    """The store's tier of a block after a failed write: unknown, so never netted away."""


_DOUBT = _Doubt()


class _Change(NamedTuple):
    base: int | _Doubt | None
    """The block's tier in the store before this change (index in TIERS; None: no record)."""
    tier: int | None
    """The tier to write (index in TIERS; None: remove the record)."""


def best_tier(mask: int) -> int | None:
    """Index in TIERS of the best tier in a mask of _MEDIUM_BIT bits; None for no tier."""
    if mask & 1:
        return 0
    if mask & 2:
        return 1
    if mask & 4:
        return 2
    return 3 if mask & 8 else None


@dataclass(eq=False, repr=False)
class KvRecordWriter:
    store: AffinityStore
    replica_id: str
    attempt: Attempt
    _: KW_ONLY
    ttl_s: float
    """TTL of the records written."""
    flush_s: float
    retry_s: float
    max_pending: int = _MAX_PENDING
    media: frozenset[str] = LOCAL_MEDIA
    """The media whose events this writer records (others are skipped)."""
    shared: bool = False
    """The records are shared with other replicas' writers (REMOTE_HOLDER's): never cleared in
    the store; an AllBlocksCleared only drops what this writer holds."""
    _media: dict[BlockHash, int] = field(default_factory=dict, init=False)
    """hash -> the tiers holding it (_MEDIUM_BIT bits), as last applied."""
    _pending: dict[BlockHash, _Change] = field(default_factory=dict, init=False)
    """Unwritten changes, oldest first; `tier` is always the best tier in `_media`."""
    _clear: bool = field(default=False, init=False)
    """The next flush starts with clear_prefixes."""
    _epoch: int = field(default=0, init=False)
    """Counts clears, so a write that fails across one does not bring back what it dropped."""
    _write_blocks: int = field(default=_MAX_WRITE_BLOCKS, init=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    last_sequence_number: int = field(default=0, init=False)
    """The last KV-event batch applied."""
    num_writes: int = field(default=0, init=False)
    """Store calls made (write_prefixes and clear_prefixes), failed ones included."""

    @property
    def num_held(self) -> int:
        return len(self._media)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def apply(self, batch: KvBatch) -> None:
        """Applies one batch in memory; `run()` writes the result."""
        media = self._media
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                media.clear()
                if self.shared:
                    self._epoch += 1
                    self._pending.clear()
                else:
                    self._start_over()
                continue
            if ev.medium not in self.media:
                continue
            bit = _MEDIUM_BIT[ev.medium]
            stored = isinstance(ev, BlockStored)
            for h in ev.block_hashes:
                old = media.get(h, 0)
                new = old | bit if stored else old & ~bit
                if new == old:
                    continue
                if new:
                    media[h] = new
                else:
                    del media[h]
                self._change(h, best_tier(old), best_tier(new))
        self.last_sequence_number = batch.sequence_number
        if len(self._pending) > len(media) + self.max_pending and not self.shared:
            self._start_over()
        self._wake_if_pending()

    def refresh(self) -> None:
        """Queues every held block for writing again (its record's TTL starts over)."""
        for h, mask in self._media.items():
            self._pending[h] = _Change(_DOUBT, best_tier(mask))
        self._wake_if_pending()

    async def run(self) -> None:
        """Flushes at most every `flush_s` while there is something to write; until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.flush_s)
            try:
                ok = await self.flush()
            except Exception:  # a bug, not a store failure (those are attempts): keep writing
                log.exception("writing KV-event records failed")
                ok = False
            if self._pending or self._clear:
                self._wake.set()
                if not ok:
                    await asyncio.sleep(self.retry_s)

    async def flush(self) -> bool:
        """Writes a pending clear and up to one call's worth of pending changes; True when
        every call succeeded (what failed stays pending)."""
        if self._clear:
            epoch = self._epoch
            self.num_writes += 1
            if not await self.attempt("clear_prefixes", self.store.clear_prefixes(self.replica_id)):
                return False
            self._clear = epoch != self._epoch  # another clear came in meanwhile
        if not self._pending:
            return True
        batch = dict(itertools.islice(self._pending.items(), self._write_blocks))
        for h in batch:
            del self._pending[h]
        epoch = self._epoch
        tiers = {h: None if c.tier is None else TIERS[c.tier] for h, c in batch.items()}
        self.num_writes += 1
        if await self.attempt(
            "write_prefixes", self.store.write_prefixes(self.replica_id, tiers, self.ttl_s)
        ):
            self._write_blocks = min(_MAX_WRITE_BLOCKS, self._write_blocks * 2)
            return True
        self._write_blocks = max(_MIN_WRITE_BLOCKS, self._write_blocks // 2)
        if epoch == self._epoch:  # else a clear dropped these; the snapshot rebuilds them
            for h, c in batch.items():
                later = self._pending.get(h)
                self._pending[h] = _Change(_DOUBT, c.tier if later is None else later.tier)
        return False

    def _change(self, h: BlockHash, base: int | None, tier: int | None) -> None:
        prev = self._pending.get(h)
        first = base if prev is None else prev.base
        if first == tier:
            self._pending.pop(h, None)
        else:
            self._pending[h] = _Change(first, tier)

    def _start_over(self) -> None:
        """Clear the replica's records, then write every held block."""
        self._epoch += 1
        self._clear = True
        self._pending = {h: _Change(None, best_tier(m)) for h, m in self._media.items()}

    def _wake_if_pending(self) -> None:
        if self._pending or self._clear:
            self._wake.set()
