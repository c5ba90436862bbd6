"""The running totals of one engine's cache tiers: one `TierCounters`, shared by the manager
(lookups: queries and hits in tokens, per tier) and the lower tiers (copies between tiers).
`engine.stats.TierStats` is what they add up to in a stats snapshot."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TierCounters:
    device_queries: int = 0
    """Prompt tokens looked up in the device tier (every admitted prompt token)."""
    device_hits: int = 0
    cpu_queries: int = 0
    """Prompt tokens looked up in the CPU tier (those past the device hit)."""
    cpu_hits: int = 0
    disk_queries: int = 0
    """Prompt tokens looked up in the disk tier (those past the device and CPU hits)."""
    disk_hits: int = 0
    device_spills: int = 0
    """Device blocks copied to the CPU tier before reuse (including swap-outs)."""
    cpu_swap_ins: int = 0
    """CPU blocks copied to the device (prefix hits and swapped-out sequences)."""
    disk_stores: int = 0
    """CPU blocks written to the disk tier before reuse."""
    disk_loads: int = 0
    """Disk blocks read into the device."""
    dropped_spills: int = 0
    """Cached device blocks reused without a spill because every CPU block was held."""
    swap_outs: int = 0
    """Sequences preempted by swap."""
    swapped_tail_tokens: int = 0
    """Tokens of partial tail blocks brought back by swap (not recomputed)."""
    disk_writes: int = 0
    """Blocks queued for disk by the write policy (write-through or selective), not write-back."""
    dropped_writes: int = 0
    """Blocks the policy wanted on disk but the writer's queue was full (or the block was gone);
    stores the writer itself refused are its `num_refused`."""
    remote_queries: int = 0
    """Prompt tokens looked up in the remote tier (those past the device, CPU and disk hits)."""
    remote_hits: int = 0
    remote_loads: int = 0
    """Remote blocks read into the device."""
    remote_writes: int = 0
    """Blocks queued for the remote tier by its write policy."""
    remote_dropped_writes: int = 0
    """Blocks the policy wanted remote but the writer's queue was full (or the block was gone)."""
    warm_blocks: int = 0
    """Disk blocks read into the CPU tier by warm start."""

    @property
    def prefix_hits(self) -> int:
        """Prompt tokens served from any tier."""
        return self.device_hits + self.cpu_hits + self.disk_hits + self.remote_hits
