"""The disk tier's index: which block hashes have a file, least recently accessed first.

Pure Python; the files themselves are engine/kv_io/disk.py's. The index has a budget in blocks; adding
past it evicts the least recently accessed entries, whose files the store deletes.
With an event buffer (`events`, set by the tiers), each hash entering the index is reported as
`BlockStored(disk)` and each one leaving it as `BlockRemoved(disk)`.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.kv.events import KVEventBuffer
from engine.kv.hashing import BlockHash


class DiskIndex:
    """hash -> block file of the disk tier, least recently accessed first, within a block budget."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(
                f"the disk tier needs room for at least one block, got {capacity_blocks}"
            )
        self.capacity = capacity_blocks
        self.entries: OrderedDict[BlockHash, None] = OrderedDict()
        self._deletes: dict[BlockHash, None] = {}
        """Files to delete (budget evictions), in order; taken by the store."""
        self.num_evictions = 0
        self.num_discarded = 0
        """Entries dropped because their file was bad or gone when looked up."""
        self.events: KVEventBuffer | None = None

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, block_hash: BlockHash) -> None:
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)

    def add(self, block_hash: BlockHash) -> None:
        """Records a file (new or found), evicting the least recently accessed over the budget."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return
        self._deletes.pop(block_hash, None)  # a pending delete of an older copy no longer applies
        self.entries[block_hash] = None
        if self.events is not None:
            self.events.stored_one(block_hash, "disk")
        while len(self.entries) > self.capacity:
            old, _ = self.entries.popitem(last=False)
            self._deletes[old] = None
            self.num_evictions += 1
            if self.events is not None:
                self.events.removed(old, "disk")

    def discard(self, block_hash: BlockHash) -> None:
        """Forgets a file that turned out bad or missing (the reader already deleted it)."""
        if self.entries.pop(block_hash, 0) is None:
            self.num_discarded += 1
            if self.events is not None:
                self.events.removed(block_hash, "disk")

    def remove(self, block_hash: BlockHash) -> None:
        """Forgets a file that is gone (a budget scan deleted it, or its write never happened)."""
        if self.entries.pop(block_hash, 0) is None and self.events is not None:
            self.events.removed(block_hash, "disk")

    def take_deletes(self) -> list[BlockHash]:
        out = list(self._deletes)
        self._deletes.clear()
        return out
