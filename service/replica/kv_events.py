"""The replica's KV-event ring: the engine's last batches, numbered, for subscribers to resume.

The engine takes its KV events once per step (engine/kv/events.py) and numbers the batches
1, 2, ...; the engine front end hands each batch to `KvEventRing.publish` on the event loop. The
ring keeps the last `capacity` batches and gives each a sequence number `base + index`, where
`base` is the ring's start time in microseconds: numbers only grow, across restarts of the
replica too, so a subscriber resuming with a number from an earlier life of the replica is
recognised as too far behind.

`subscribe(start)` yields the batches numbered `start` and later, then waits for more. When
`start` is no longer in the ring (it fell out, the replica restarted, or `start` is 0) the
subscriber first gets a snapshot batch: AllBlocksCleared followed by BlockStored for every hash
the engine's tiers hold (`kv_snapshot`), numbered like the last batch it includes, with
`dropped` set; it then continues from there. A subscriber that falls behind the ring while it
reads gets another snapshot. Used by the SubscribeKvEvents RPC and, in process, by the replica
agent.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from engine.kv.events import AllBlocksCleared, KVEvent, KVEventBatch, KVSnapshot

DEFAULT_RING_BATCHES = 1024


@dataclass(frozen=True, slots=True)
class KvBatch:
    """One numbered batch as subscribers see it."""

    sequence_number: int
    timestamp: float
    """Unix time the engine took it (a snapshot: when the ring built it)."""
    events: list[KVEvent]
    dropped: bool = False
    """Events were lost before this batch: it starts with AllBlocksCleared and a snapshot."""


class KvEventRing:
    def __init__(
        self,
        snapshot: Callable[[], Awaitable[KVSnapshot]],
        capacity: int = DEFAULT_RING_BATCHES,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"the KV event ring needs room for a batch, got {capacity}")
        self._snapshot = snapshot
        self._batches: deque[KvBatch] = deque(maxlen=capacity)
        self.base = time.time_ns() // 1000
        self._tail = self.base
        """The highest sequence number described so far (by a batch or a snapshot)."""
        self._changed = asyncio.Event()
        self._closed = False
        self.num_snapshots = 0

    @property
    def last_sequence_number(self) -> int:
        return self._tail

    def publish(self, batch: KVEventBatch) -> None:
        """Adds the engine's next batch (event loop thread) and wakes the subscribers."""
        if self._closed:
            return
        seq = self.base + batch.index
        self._batches.append(KvBatch(seq, batch.timestamp, batch.events, batch.dropped))
        self._tail = max(self._tail, seq)
        self._wake()

    def close(self) -> None:
        """Ends every subscription (after what it has been given)."""
        self._closed = True
        self._wake()

    async def subscribe(self, start_sequence_number: int) -> AsyncIterator[KvBatch]:
        """Batches from `start_sequence_number` on, a snapshot first when it is not in the ring;
        ends when the ring is closed."""
        next_seq = start_sequence_number
        while not self._closed:
            if not self._resumable(next_seq):
                batch = await self._take_snapshot()
                yield batch
                next_seq = batch.sequence_number + 1
                continue
            changed = self._changed
            ready = [b for b in self._batches if b.sequence_number >= next_seq]
            if not ready:
                await changed.wait()
                continue
            for b in ready:
                yield b
                next_seq = b.sequence_number + 1

    def _resumable(self, seq: int) -> bool:
        first = self._batches[0].sequence_number if self._batches else self._tail + 1
        return seq > self.base and first <= seq <= self._tail + 1

    async def _take_snapshot(self) -> KvBatch:
        snap = await self._snapshot()
        self.num_snapshots += 1
        seq = self.base + snap.after_index
        self._tail = max(self._tail, seq)
        return KvBatch(seq, time.time(), [AllBlocksCleared(), *snap.events], dropped=True)

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
