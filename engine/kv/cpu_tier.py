"""The CPU tier's blocks: which host block holds a hash, who holds each block, what is evicted.

Pure Python on integer block ids and hashes. The tier is a `BlockPool` with its own hash index and
LRU; a block's ref count is the sum of: one step reference, one per swapped-out sequence that
holds it (the swap records of `TieredCache`, engine/kv/tiers.py), one for a pin.
- Step references: a block that is a spill target, a swap-in source, or a lookup hit holds one
  reference until `end_step`, so no later op of the same step reuses it (the hazard rule of
  `KVPlan`).
- Pins: a pinned hash keeps its block (now or when it arrives) out of eviction until the TTL
  passes; at most `max_pinned` hashes are pinned.
- Eviction: a cached block reused by `alloc` leaves the tier (`BlockRemoved(cpu)`) and is handed
  to the disk tier below, which may plan its store in the plan being built.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv.block_pool import Block, BlockPool
from engine.kv.disk_tier import DiskTier
from engine.kv.events import KVEventBuffer
from engine.kv.hashing import BlockHash
from engine.kv.plan import KVPlan


class CpuTier:
    """The CPU tier's `BlockPool`, its step references and its pins."""

    def __init__(
        self,
        num_blocks: int,
        *,
        max_pinned_fraction: float,
        events: KVEventBuffer | None,
        below: DiskTier | None,
    ) -> None:
        self.pool = BlockPool(num_blocks, on_evict=self._on_evict)
        self.events = events
        """Where hashes entering and leaving the tier are reported."""
        self.below = below
        """The disk tier, offered each evicted block (None: no disk tier)."""
        self.max_pinned = int(max_pinned_fraction * num_blocks)
        self.pins: dict[BlockHash, float] = {}
        """hash -> expiry of its pin."""
        self._pinned_blocks: dict[BlockHash, Block] = {}
        """Pinned hashes present in the tier -> their block (holding one reference)."""
        self._step_refs: list[Block] = []
        """Blocks holding one step reference, in the order taken."""
        self._step_held: set[int] = set()
        """Ids of those blocks."""
        self._plan: KVPlan | None = None
        """The plan that evictions append disk stores to, set while `alloc` allocates."""

    # -- step references -----------------------------------------------------------------------
    def hold_for_step(self, b: Block) -> None:
        """Takes the block's step reference unless it holds one."""
        if b.block_id not in self._step_held:
            self.pool.touch([b])
            self._step_held.add(b.block_id)
            self._step_refs.append(b)

    def hold_new_for_step(self, b: Block) -> None:
        """Turns a reference the caller already took into the block's step reference."""
        assert b.block_id not in self._step_held
        self._step_held.add(b.block_id)
        self._step_refs.append(b)

    def hand_to_step(self, blocks: Iterable[Block]) -> None:
        """Turns the caller's reference on each block into its step reference (dropped where the
        block already holds one)."""
        for b in blocks:
            if b.block_id in self._step_held:
                self.pool.free([b])
            else:
                self.hold_new_for_step(b)

    def end_step(self) -> None:
        """Releases the step references."""
        refs, self._step_refs, self._step_held = self._step_refs, [], set()
        self.pool.free(refs)

    # -- placement -----------------------------------------------------------------------------
    def alloc(self, plan: KVPlan) -> Block | None:
        """One block (ref 1), evicting the least recently used cached one (its disk store goes
        into `plan`); None if all are held."""
        if self.pool.num_free == 0:
            return None
        self._plan = plan
        try:
            (b,) = self.pool.allocate(1)
        finally:
            self._plan = None
        return b

    def cache_new(self, b: Block, block_hash: BlockHash) -> None:
        """Caches a block just allocated for a spill under its hash (reported, and held for the
        hash's pin if it has one)."""
        self.pool.cache(b, block_hash)
        if self.events is not None:
            self.events.stored_one(block_hash, "cpu")
        if block_hash in self.pins:
            self._pin_hold(block_hash)

    def warm_target(self, block_hash: BlockHash) -> int | None:
        """A block to fill with this disk block's bytes at warm start, now cached under its hash
        and free (in the LRU), or None when the hash is present or no never-used block is left
        (warm start never evicts)."""
        cpu = self.pool
        if cpu.lookup(block_hash) is not None:
            return None
        if cpu.num_free == 0 or len(cpu.cached) + cpu.num_used >= cpu.num_blocks:
            return None
        head = next(iter(cpu.free_queue), None)
        if head is None or head.block_hash is not None:
            return None
        (b,) = cpu.allocate(1)
        cpu.cache(b, block_hash)
        cpu.free([b])
        if self.events is not None:
            self.events.stored_one(block_hash, "cpu")
        return b.block_id

    def _on_evict(self, block: Block, block_hash: BlockHash) -> None:
        if block_hash in self._pinned_blocks:
            raise AssertionError(f"pinned CPU {block} reached the free queue")
        if self.events is not None:
            self.events.removed(block_hash, "cpu")
        if self.below is not None:
            self.below.on_cpu_evict(
                block.block_id, block_hash, self._plan, pinned=block_hash in self.pins
            )

    # -- pins ----------------------------------------------------------------------------------
    def pin(self, hashes: list[BlockHash], until: float) -> bool:
        """Keeps these hashes' blocks (present or arriving) out of eviction until `until`.

        False (and nothing pinned) when that would exceed the cap.
        """
        new = {h for h in hashes if h not in self.pins}
        if len(self.pins) + len(new) > self.max_pinned:
            return False
        for h in hashes:
            self.pins[h] = max(until, self.pins.get(h, 0.0))
            self._pin_hold(h)
        return True

    def expire_pins(self, now: float) -> None:
        expired = [h for h, t in self.pins.items() if t <= now]
        for h in expired:
            del self.pins[h]
            b = self._pinned_blocks.pop(h, None)
            if b is not None:
                self.pool.free([b])

    @property
    def num_pinned_blocks(self) -> int:
        """Pinned hashes present in the tier."""
        return len(self._pinned_blocks)

    def _pin_hold(self, block_hash: BlockHash) -> None:
        if block_hash in self._pinned_blocks:
            return
        b = self.pool.lookup(block_hash)
        if b is not None:
            self.pool.touch([b])
            self._pinned_blocks[block_hash] = b

    # -- checks --------------------------------------------------------------------------------
    def check_integrity(self, swap_holders: Iterable[Block]) -> None:
        """Pool integrity, and every reference accounted for by a step, a pin or one of
        `swap_holders` (a block once per swapped-out sequence holding it)."""
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for b in self._step_refs:
            refs[b.block_id] += 1
        if len(self._step_refs) != len(self._step_held):
            raise AssertionError("a CPU block holds two step references")
        for b in swap_holders:
            refs[b.block_id] += 1
        for h, b in self._pinned_blocks.items():
            if b.block_hash != h:
                raise AssertionError(f"pinned {b} lost its hash")
            refs[b.block_id] += 1
        for b in self.pool.blocks:
            if refs[b.block_id] != b.ref_cnt:
                raise AssertionError(
                    f"CPU {b} has ref_cnt {b.ref_cnt} but {refs[b.block_id]} holders"
                )
        if len(self.pins) > self.max_pinned:
            raise AssertionError("more pinned hashes than the cap")
