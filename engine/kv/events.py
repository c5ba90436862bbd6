"""KV events: what the cache manager stored and dropped, per tier, in vLLM's event shapes.

Pure Python, no I/O. The manager, the tiers and the disk index append events to one
`KVEventBuffer` as they change which hashes a tier holds; the engine takes the buffer's content
once per step (`LLMEngine.take_kv_events`, outside the step's bookkeeping) and ships it as one
`KVEventBatch`.

Rules:
- `medium` is "device", "cpu", "disk" or "remote" (the tier shared by replicas: stored when the
  store acknowledged a write, removed when a lookup found the block absent or bad). A block moving from one tier to another is a removal
  from the first and a store in the second (a device block spilled to the CPU tier and then
  reused on the device: `BlockStored(cpu)`, `BlockRemoved(device)`).
- Device stores carry the parent hash of their first block (None for a prompt's first block) and
  the blocks' token ids, as vLLM's do. CPU and disk stores carry neither (`parent_block_hash`
  None, `token_ids` empty): those tiers only see hashes (vLLM's offloading connector does the
  same).
- Consecutive removals from one medium, and consecutive lower-tier stores, merge into one event.
- The buffer holds at most `max_blocks` block hashes. Past that it drops everything it holds and
  every event until the next `take`, which then reports `overflowed`: the engine sends
  `AllBlocksCleared` followed by a snapshot of what is cached, and consumers resync from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv.hashing import BlockHash

MEDIA = ("device", "cpu", "disk", "remote")


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    """A chain of newly held blocks, in order."""
    parent_block_hash: BlockHash | None
    """Parent of the first block (None: a first block, or unknown in the CPU and disk tiers)."""
    token_ids: list[int]
    """The blocks' tokens, `block_size` per block (empty in the CPU and disk tiers)."""
    block_size: int
    medium: str


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str


@dataclass(slots=True)
class AllBlocksCleared:
    """Forget everything this engine was said to hold; what follows describes its cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """The events of one engine step (or one snapshot), in order."""

    index: int
    """Batches the engine took before and with this one (1, 2, ...)."""
    timestamp: float
    """Unix time the engine took the batch."""
    events: list[KVEvent] = field(default_factory=list)
    dropped: bool = False
    """Events were dropped (the buffer was full): `events` is AllBlocksCleared + a snapshot."""


@dataclass(slots=True)
class KVSnapshot:
    """What the engine's tiers hold, as of the batch numbered `after_index`."""

    after_index: int
    """The snapshot includes the effect of every batch up to this index (and maybe of events
    taken later: those are idempotent to replay)."""
    events: list[KVEvent]
    """BlockStored per medium (device, then cpu, then disk), hashes only."""


class KVEventBuffer:
    """Events since the last `take`, bounded by `max_blocks` hashes (see the module docstring)."""

    def __init__(self, max_blocks: int, block_size: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"a KV event buffer needs room for a block, got {max_blocks}")
        self.max_blocks = max_blocks
        self.block_size = block_size
        self._events: list[KVEvent] = []
        self._tail_removed: BlockRemoved | None = None
        """The last event when it is a removal (the next removal may merge into it)."""
        self._blocks = 0
        self.overflowed = False
        self.num_overflows = 0
        """Times the buffer filled up since start."""

    def __bool__(self) -> bool:
        return bool(self._events) or self.overflowed

    def stored(
        self,
        block_hashes: list[BlockHash],
        parent: BlockHash | None,
        token_ids: list[int],
        medium: str,
    ) -> None:
        if not self._room(len(block_hashes)):
            return
        self._tail_removed = None
        last = self._events[-1] if self._events else None
        if (
            medium != "device"
            and type(last) is BlockStored
            and last.medium == medium
            and not last.token_ids
        ):
            last.block_hashes.extend(block_hashes)
            return
        self._events.append(BlockStored(block_hashes, parent, token_ids, self.block_size, medium))

    def stored_one(self, block_hash: BlockHash, medium: str) -> None:
        """A lower-tier (cpu, disk) store of one hash."""
        self.stored([block_hash], None, [], medium)

    def stored_many(self, block_hashes: list[BlockHash], medium: str) -> None:
        """A lower-tier store of several hashes (not a chain)."""
        self.stored(list(block_hashes), None, [], medium)

    def removed(self, block_hash: BlockHash, medium: str) -> None:
        # NOTE: called once per evicted block: kept to a few attribute reads.
        if self.overflowed:
            return
        self._blocks += 1
        if self._blocks > self.max_blocks:
            self._overflow()
            return
        last = self._tail_removed
        if last is not None and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            last = self._tail_removed = BlockRemoved([block_hash], medium)
            self._events.append(last)

    def removed_many(self, block_hashes: Sequence[BlockHash], medium: str) -> None:
        for h in block_hashes:
            self.removed(h, medium)

    def cleared(self) -> None:
        """Everything is gone: earlier events no longer matter."""
        self._events = [AllBlocksCleared()]
        self._blocks = 0
        self._tail_removed = None

    def take(self) -> tuple[list[KVEvent], bool]:
        """(events since the last take, whether some were dropped); empties the buffer."""
        out, overflowed = self._events, self.overflowed
        self._events, self._blocks, self.overflowed = [], 0, False
        self._tail_removed = None
        return ([] if overflowed else out), overflowed

    def _room(self, n: int) -> bool:
        if self.overflowed:
            return False
        if self._blocks + n > self.max_blocks:
            self._overflow()
            return False
        self._blocks += n
        return True

    def _overflow(self) -> None:
        self.overflowed = True
        self.num_overflows += 1
        self._events, self._blocks, self._tail_removed = [], 0, None


def snapshot_events(
    block_size: int, by_medium: Sequence[tuple[str, list[BlockHash]]]
) -> list[KVEvent]:
    """BlockStored events (hashes only) for what each medium holds; empty media are skipped."""
    return [BlockStored(list(h), None, [], block_size, m) for m, h in by_medium if h]
