"""What a lower tier's write policy wants written (the disk and the remote tier each hold one).

Pure Python on block hashes. Hashes are queued in order (`want`), never one the tier already
`holds`; under the selective policy a hash is queued once it has been hit `min_hits` times
(`count_hits`, bounded). After each step the engine takes the queue (`take`), each hash resolved
to the device or CPU block that holds it then, at most `room` of them; the rest are dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.kv.block_pool import BlockPool
from engine.kv.hashing import BlockHash


@dataclass(slots=True)
class DiskWrites:
    """Blocks to copy into staging memory now and queue for a tier's writer (`take`)."""

    from_device: list[tuple[int, BlockHash]] = field(default_factory=list)
    """(device block id, hash)."""
    from_cpu: list[tuple[int, BlockHash]] = field(default_factory=list)
    """(cpu block id, hash)."""

    def __bool__(self) -> bool:
        return bool(self.from_device or self.from_cpu)

    def hashes(self) -> list[BlockHash]:
        return [h for _, h in self.from_device] + [h for _, h in self.from_cpu]


class WriteQueue:
    """Hashes a tier's write policy wants written, in order, and the selective policy's hits."""

    def __init__(
        self, holds: Callable[[BlockHash], bool], min_hits: int, max_hit_entries: int
    ) -> None:
        self.holds = holds
        """Whether the tier already holds (or is writing) a hash: it is never queued."""
        self.min_hits = min_hits
        self._max_hit_entries = max_hit_entries
        self._writes: dict[BlockHash, None] = {}
        self._hits: OrderedDict[BlockHash, int] = OrderedDict()
        """Prefix hits per hash, least recently hit first, bounded."""

    def want(self, block_hash: BlockHash) -> None:
        if not self.holds(block_hash):
            self._writes[block_hash] = None

    def hits(self, block_hash: BlockHash) -> int:
        """Prefix hits counted for the hash (0 when not counted or forgotten)."""
        return self._hits.get(block_hash, 0)

    def count_hits(self, hashes: Iterable[BlockHash]) -> None:
        """Counts prefix hits; a hash reaching `min_hits` is queued."""
        counts = self._hits
        for h in hashes:
            n = counts.pop(h, 0) + 1
            counts[h] = n
            if n == self.min_hits:
                self.want(h)
        while len(counts) > self._max_hit_entries:
            counts.popitem(last=False)

    def take(
        self, room: int, device_lookup: Callable[[BlockHash], int | None], cpu: BlockPool | None
    ) -> tuple[DiskWrites, int]:
        """(the queued hashes resolved to the block that holds them now, device first, at most
        `room` of them; how many were dropped: no room, or evicted from both before the step
        ended). Empties the queue. Call between steps (no plan pending)."""
        out, dropped = DiskWrites(), 0
        queued, self._writes = self._writes, {}
        for h in queued:
            if self.holds(h):
                continue
            if room <= 0:
                dropped += 1
                continue
            dev = device_lookup(h)
            if dev is not None:
                out.from_device.append((dev, h))
            else:
                b = cpu.lookup(h) if cpu is not None else None
                if b is None:
                    dropped += 1
                    continue
                out.from_cpu.append((b.block_id, h))
            room -= 1
        return out, dropped

    def clear(self) -> None:
        self._writes.clear()
