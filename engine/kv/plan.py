"""Copy plans: what the allocator asks the runner to move before a forward pass.

The allocator decides; the runner carries the plan out on tensors, in this order:
    1. disk_store  CPU block -> disk file   (the CPU block is about to be reused)
    2. spill       device block -> CPU block (the device block is about to be reused)
    3. disk_load   disk file -> device block (a disk-tier hit)
    3b. remote_load remote payload -> device block (a remote-tier hit, read before the step)
    4. swap_in     CPU block -> device block (a CPU-tier hit, or a swapped-out sequence)
    5. cow         device block -> device block (copy-on-write of a shared partial block)
NOTE: the order is safe because a CPU block that is the target of a spill or the source of a
swap-in holds a reference until the step ends, so no later op of the same step reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.hashing import BlockHash


@dataclass(slots=True)
class KVPlan:
    disk_store: list[tuple[int, BlockHash]] = field(default_factory=list)
    """(cpu block id, hash): write the CPU block to the disk tier under its hash."""
    spill: list[tuple[int, int]] = field(default_factory=list)
    """(device block id, cpu block id)."""
    disk_load: list[tuple[BlockHash, int]] = field(default_factory=list)
    """(hash, device block id): read the disk tier's block into a device block."""
    remote_load: list[tuple[BlockHash, int]] = field(default_factory=list)
    """(hash, device block id): copy the remote tier's buffered block into a device block."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(cpu block id, device block id)."""
    cow: list[tuple[int, int]] = field(default_factory=list)
    """(src device block id, dst device block id)."""

    def __bool__(self) -> bool:
        return bool(
            self.disk_store
            or self.spill
            or self.disk_load
            or self.remote_load
            or self.swap_in
            or self.cow
        )

    def extend(self, other: KVPlan) -> None:
        self.disk_store += other.disk_store
        self.spill += other.spill
        self.disk_load += other.disk_load
        self.remote_load += other.remote_load
        self.swap_in += other.swap_in
        self.cow += other.cow
