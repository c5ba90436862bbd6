"""The tiers below the device pool: a CPU tier of host blocks, and the disk tier below it.

Pure Python on integer block ids and hashes; no torch, no file I/O (engine/kv_io/offload.py carries the
plans out and reads the files). `TieredCache` implements the `LowerTiers` protocol of
`KVCacheManager`: it plans the copies between the tiers. Which CPU block holds what, its
references and pins are its `CpuTier`'s (engine/kv/cpu_tier.py); what is on disk and what goes
there (the index, the probes, the write policies) is its `DiskTier`'s (engine/kv/disk_tier.py).

Rules:
- Write-back spill: when the device tier reuses a cached block, the block is first copied to the
  CPU tier (`KVPlan.spill`) unless the CPU tier already holds its hash (then that CPU block only
  moves to the most recently used end of the CPU LRU).
- Step references (engine/kv/cpu_tier.py): a CPU block that is a spill target, a swap-in source,
  or was found by `find` holds one until `end_step`. `find` holding what it finds also guarantees
  that a hit is still there when the manager fetches it, after allocating device blocks (whose
  spills may evict CPU blocks).
- Disk tier: when the CPU tier reuses a cached block, its `DiskTier` may plan a disk store first
  (`KVPlan.disk_store`); `find` looks on disk after a CPU miss, its hits verified there.
- A device block that is a fetch destination of this step is never spilled when it is reused in
  the same step (its bytes have not arrived; the source tier still holds the hash), and a second
  fetch into the same device block in one step supersedes the first.
- Preemption by swap: `swap_out` plans spills of a sequence's computed blocks (full blocks under
  their hashes, shared with the prefix cache; the partial tail in a private block with no hash)
  and holds them until `resume` or `drop_swap`. The sequence comes back through the prefix cache
  (its full blocks are CPU or device hits); `resume` swaps the private tail in.
- Remote tier (engine/kv/remote_tier.py), below the disk tier: `find` answers from the payloads a
  request's lookup verified before its admission (never the network); its write policy queues
  hashes that `take_remote_writes` resolves between steps.
- KV events (the `events` buffer, engine/kv/events.py): a hash entering the CPU tier (spill,
  swap-out, warm start) is `BlockStored(cpu)`, one leaving it `BlockRemoved(cpu)`, reported by
  the `CpuTier`; the disk tier reports its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv.block_pool import Block
from engine.kv.counters import TierCounters
from engine.kv.cpu_tier import CpuTier
from engine.kv.disk_index import DiskIndex
from engine.kv.disk_tier import WRITE_POLICIES, DiskIO, DiskTier
from engine.kv.events import KVEventBuffer
from engine.kv.hashing import BlockHash
from engine.kv.plan import KVPlan
from engine.kv.remote_tier import RemoteIO, RemoteTier
from engine.kv.write_queue import DiskWrites
from engine.stats import TierStats


class SeqState(Protocol):
    """What swap preemption reads of a sequence."""

    seq_id: int
    block_hashes: list[BlockHash]
    num_computed_tokens: int


@dataclass(slots=True)
class SwapRecord:
    """A swapped-out sequence's CPU blocks, each holding one reference for it."""

    blocks: list[Block]
    """Its full computed blocks in order (cached under their hashes), then the private tail."""
    num_full: int
    tail_tokens: int
    """Computed tokens in the partial tail block (0: no tail block)."""


@dataclass(slots=True)
class _Step:
    """Transient state of the step being planned; cleared by `end_step`."""

    fetch_dst: set[int] = field(default_factory=set)
    """Device blocks this step's plan fills from a lower tier."""
    spill_dst: set[int] = field(default_factory=set)
    """CPU blocks this step's plan fills by a spill: never a hit or swap-in source in the same
    step (the hazard rule: a block written by a plan is not read by the same plan)."""


class TieredCache:
    """CPU tier + disk-tier index below a `KVCacheManager` (its `tiers`)."""

    def __init__(
        self,
        num_cpu_blocks: int,
        block_size: int,
        *,
        disk: DiskIndex | None = None,
        disk_io: DiskIO | None = None,
        max_pinned_fraction: float = 0.5,
        write_policy: str = "write-back",
        min_hits: int = 2,
        events: KVEventBuffer | None = None,
        remote: RemoteIO | None = None,
        remote_write_policy: str = "write-through",
    ) -> None:
        if (disk is None) != (disk_io is None):
            raise ValueError("the disk tier needs both its index and its file reader")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.block_size = block_size
        self.counters = TierCounters()
        """Shared with the KVCacheManager this cache sits below (it counts the lookups)."""
        self._disk = (
            DiskTier(
                disk,
                disk_io,
                self.counters,
                write_policy=write_policy,
                min_hits=min_hits,
                max_hit_entries=max(4096, 8 * num_cpu_blocks),
                events=events,
            )
            if disk is not None and disk_io is not None
            else None
        )
        self._cpu = CpuTier(
            num_cpu_blocks,
            max_pinned_fraction=max_pinned_fraction,
            events=events,
            below=self._disk,
        )
        self.cpu = self._cpu.pool
        """The CPU tier's blocks."""
        self.remote = (
            RemoteTier(
                remote,
                self.counters,
                write_policy=remote_write_policy,
                min_hits=min_hits,
                events=events,
            )
            if remote is not None
            else None
        )
        """The remote tier's bookkeeping (None: no remote tier)."""
        self.swapped: dict[int, SwapRecord] = {}
        """seq_id -> the CPU blocks of a sequence preempted by swap."""
        self._step = _Step()

    @property
    def pins(self) -> dict[BlockHash, float]:
        """hash -> expiry of its pin."""
        return self._cpu.pins

    @property
    def max_pinned(self) -> int:
        return self._cpu.max_pinned

    @property
    def disk(self) -> DiskIndex | None:
        """The disk tier's index (None: no disk tier)."""
        return self._disk.index if self._disk is not None else None

    @property
    def disk_io(self) -> DiskIO | None:
        """The disk tier's file reader (None: no disk tier)."""
        return self._disk.io if self._disk is not None else None

    # -- LowerTiers ----------------------------------------------------------------------------
    def find(self, block_hash: BlockHash) -> str | None:
        """The tier holding the hash ("cpu" before "disk" before "remote") or None.

        NOTE: a CPU hit is held until `end_step` and a disk hit's bytes are read and verified
        now, so a hit found in a step can be fetched in that step whatever else it evicts.
        """
        b = self.cpu.lookup(block_hash)
        if b is not None and b.block_id not in self._step.spill_dst:
            self._cpu.hold_for_step(b)
            return "cpu"
        if self._disk is not None and self._disk.find(block_hash):
            return "disk"
        if self.remote is not None and self.remote.find(block_hash):
            return "remote"
        return None

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether the CPU tier or the disk index holds the hash (no probe, no hold): what a
        remote lookup need not ask for."""
        return self.cpu.lookup(block_hash) is not None or (
            self._disk is not None and self._disk.enabled and block_hash in self._disk.index
        )

    def fetch(self, block_hash: BlockHash, dst_block_id: int, plan: KVPlan) -> None:
        """Plans the copy of a hit found in this step into device block `dst_block_id`."""
        step = self._step
        self._supersede(dst_block_id, plan)
        b = self.cpu.lookup(block_hash)
        if b is not None and b.block_id not in step.spill_dst:
            self._cpu.hold_for_step(b)
            plan.swap_in.append((b.block_id, dst_block_id))
            self.counters.cpu_swap_ins += 1
        elif (self._disk is None or not self._disk.fetch(block_hash, dst_block_id, plan)) and (
            self.remote is None or not self.remote.fetch(block_hash, dst_block_id, plan)
        ):
            raise AssertionError(
                f"fetch of {block_hash.hex()[:16]}, which find did not return this step"
            )
        step.fetch_dst.add(dst_block_id)

    def on_device_evict(self, block_id: int, block_hash: BlockHash, plan: KVPlan) -> None:
        """Plans the spill of a cached device block about to be reused (write-back)."""
        if block_id in self._step.fetch_dst:
            return  # its bytes arrive with this step's plan; the source tier holds the hash
        b = self.cpu.lookup(block_hash)
        if b is not None:
            if b.ref_cnt == 0:  # move to the most recently used end of the CPU LRU
                self.cpu.touch([b])
                self.cpu.free([b])
            return
        c = self._cpu.alloc(plan)
        if c is None:
            self.counters.dropped_spills += 1
            return
        self._cpu.cache_new(c, block_hash)
        self._cpu.hold_new_for_step(c)
        self._plan_spill(block_id, c, plan)

    def end_step(self) -> None:
        """The step's plan has been carried out: release its CPU references and read buffer."""
        self._step = _Step()
        self._cpu.end_step()
        if self._disk is not None:
            self._disk.end_step()
        if self.remote is not None:
            self.remote.end_step()

    def on_cached(self, block_hash: BlockHash) -> None:
        """A newly computed full device block: write-through queues it for disk and remote."""
        if self._disk is not None:
            self._disk.on_cached(block_hash)
        if self.remote is not None:
            self.remote.on_cached(block_hash)

    def note_hits(self, hashes: list[BlockHash]) -> None:
        """Counts prefix hits; under `selective` a hash reaching `min_hits` is queued."""
        if self._disk is not None:
            self._disk.note_hits(hashes)
        if self.remote is not None:
            self.remote.note_hits(hashes)

    # -- the write policy's disk writes --------------------------------------------------------
    def take_writes(
        self, room: int, device_lookup: Callable[[BlockHash], int | None]
    ) -> DiskWrites:
        """The queued disk writes resolved to the blocks that hold them now, at most `room` of
        them (see `DiskTier.take_writes`)."""
        if self._disk is None:
            return DiskWrites()
        return self._disk.take_writes(room, device_lookup, self.cpu)

    def take_remote_writes(
        self, room: int, device_lookup: Callable[[BlockHash], int | None]
    ) -> DiskWrites:
        """The remote write policy's queued writes resolved to blocks, `room` at most."""
        if self.remote is None:
            return DiskWrites()
        return self.remote.take_writes(room, device_lookup, self.cpu)

    def forget_write(self, block_hash: BlockHash) -> None:
        """A taken write did not reach the writer (refused there, and counted there)."""
        if self._disk is not None:
            self._disk.index.remove(block_hash)

    # -- warm start and republishing -----------------------------------------------------------
    def warm_target(self, block_hash: BlockHash) -> int | None:
        """A CPU block to fill with this disk block's bytes at warm start (see
        `CpuTier.warm_target`), or None."""
        block_id = self._cpu.warm_target(block_hash)
        if block_id is not None:
            self.counters.warm_blocks += 1
        return block_id

    def cached_hashes(self, limit: int) -> list[BlockHash]:
        """Up to `limit` hashes the CPU then disk tiers hold, most recently used first."""
        out: list[BlockHash] = []
        seen: set[BlockHash] = set()
        cpu_order = [b.block_hash for b in self.cpu.free_queue if b.block_hash is not None]
        held = [b.block_hash for b in self.cpu.blocks if b.ref_cnt and b.block_hash is not None]
        sources: list[Iterable[BlockHash]] = [held, reversed(cpu_order)]
        if self._disk is not None and self._disk.enabled:
            sources.append(reversed(self._disk.index.entries))
        for src in sources:
            for h in src:
                if len(out) >= limit:
                    return out
                if h not in seen:
                    seen.add(h)
                    out.append(h)
        return out

    def held_by_medium(self) -> list[tuple[str, list[BlockHash]]]:
        """Every hash the CPU tier and the disk index hold now (a KV-event snapshot)."""
        out = [("cpu", list(self.cpu.cached))]
        if self._disk is not None and self._disk.enabled:
            out.append(("disk", list(self._disk.index.entries)))
        if self.remote is not None:
            out.append(("remote", list(self.remote.known)))
        return out

    # -- swap preemption -----------------------------------------------------------------------
    def swap_out(self, seq: SeqState, device_block_ids: Sequence[int], plan: KVPlan) -> bool:
        """Plans spills of the sequence's computed blocks and holds them for it.

        False (and nothing planned) when the CPU tier cannot take them all.
        """
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_hashes), len(device_block_ids))
        tail = seq.num_computed_tokens - num_full * bs
        if tail >= bs or (tail and len(device_block_ids) <= num_full):
            return False  # computed tokens without hashes or blocks: not a state swap can keep
        found = [self.cpu.lookup(h) for h in seq.block_hashes[:num_full]]
        # Free CPU blocks this takes: the free ones it finds, plus one per new copy.
        need = sum(1 for b in found if b is None or b.ref_cnt == 0) + (1 if tail else 0)
        if need > self.cpu.num_free:
            return False
        self.cpu.touch(b for b in found if b is not None)
        blocks: list[Block] = []
        for i, b in enumerate(found):
            if b is None:
                b = self._cpu.alloc(plan)
                assert b is not None
                self._cpu.cache_new(b, seq.block_hashes[i])
                self._plan_spill(device_block_ids[i], b, plan)
            blocks.append(b)
        if tail:
            t = self._cpu.alloc(plan)
            assert t is not None
            self._plan_spill(device_block_ids[num_full], t, plan)
            blocks.append(t)
        self.swapped[seq.seq_id] = SwapRecord(blocks, num_full, tail)
        self.counters.swap_outs += 1
        return True

    def resume(
        self,
        seq: SeqState,
        num_matched_blocks: int,
        num_new_tokens: int,
        device_block_ids: Sequence[int],
        plan: KVPlan,
    ) -> int:
        """A swapped-out sequence was readmitted through the prefix cache: release its CPU blocks
        (at the end of the step) and swap its partial tail in when the match reached it.

        Returns the tail tokens swapped in (added to seq.num_computed_tokens), else 0.
        """
        rec = self.swapped.pop(seq.seq_id, None)
        if rec is None:
            return 0
        self._cpu.hand_to_step(rec.blocks)  # the swap's references become the step's
        bs = self.block_size
        if not (
            rec.tail_tokens
            and num_matched_blocks == rec.num_full
            and seq.num_computed_tokens == rec.num_full * bs
            and num_new_tokens > rec.tail_tokens
            and len(device_block_ids) > rec.num_full
        ):
            return 0
        dst = device_block_ids[rec.num_full]
        self._supersede(dst, plan)
        plan.swap_in.append((rec.blocks[-1].block_id, dst))
        self._step.fetch_dst.add(dst)
        self.counters.cpu_swap_ins += 1
        self.counters.swapped_tail_tokens += rec.tail_tokens
        seq.num_computed_tokens += rec.tail_tokens
        return rec.tail_tokens

    def drop_swap(self, seq_id: int) -> None:
        """The swapped-out sequence ended while waiting: release its CPU blocks."""
        rec = self.swapped.pop(seq_id, None)
        if rec is not None:
            self.cpu.free(reversed(rec.blocks))

    # -- pins ----------------------------------------------------------------------------------
    def pin(self, hashes: Iterable[BlockHash], until: float) -> bool:
        """Keeps these hashes' CPU blocks (present or arriving) out of eviction until `until`.

        False (and nothing pinned) when that would exceed the cap.
        """
        hashes = list(hashes)
        if not self._cpu.pin(hashes, until):
            return False
        for h in hashes:
            if self._disk is not None:
                self._disk.on_pinned(h)
            if self.remote is not None:
                self.remote.on_pinned(h)
        return True

    def expire_pins(self, now: float) -> None:
        self._cpu.expire_pins(now)

    # -- stats and checks ----------------------------------------------------------------------
    def add_stats(self, tiers: list[TierStats], block_bytes: int) -> None:
        """Fills the device tier's spill figures and appends the cpu and disk tiers' stats."""
        c = self.counters
        for t in tiers:
            if t.name == "device":
                t.spills = c.device_spills
                t.bytes_moved = (
                    c.device_spills + c.cpu_swap_ins + c.disk_loads + c.remote_loads
                ) * block_bytes
        cpu = self.cpu
        tiers.append(
            TierStats(
                name="cpu",
                num_blocks=cpu.num_blocks,
                # cached blocks + the private tails of swapped-out sequences
                used_blocks=len(cpu.cached)
                + sum(1 for r in self.swapped.values() if r.tail_tokens),
                cached_blocks=len(cpu.cached),
                pinned_blocks=self._cpu.num_pinned_blocks,
                queries=c.cpu_queries,
                hits=c.cpu_hits,
                spills=c.disk_stores,
                swap_ins=c.cpu_swap_ins,
                evictions=cpu.num_evictions,
                bytes_moved=(c.device_spills + c.cpu_swap_ins + c.disk_stores) * block_bytes,
            )
        )
        if self._disk is not None:
            tiers.append(self._disk.stats(block_bytes))
        if self.remote is not None:
            tiers.append(self.remote.stats(block_bytes))

    def check_integrity(self) -> None:
        """CPU pool integrity, and every CPU reference accounted for by a step, swap or pin."""
        self._cpu.check_integrity(b for rec in self.swapped.values() for b in rec.blocks)

    # -- internals -----------------------------------------------------------------------------
    def _plan_spill(self, device_block_id: int, cpu_block: Block, plan: KVPlan) -> None:
        """Plans the copy of a device block into a CPU block allocated for it."""
        plan.spill.append((device_block_id, cpu_block.block_id))
        self._step.spill_dst.add(cpu_block.block_id)
        self.counters.device_spills += 1

    def _supersede(self, dst: int, plan: KVPlan) -> None:
        """A fetch into `dst` replaces an earlier fetch into it in the same step."""
        if dst in self._step.fetch_dst:
            plan.swap_in[:] = [p for p in plan.swap_in if p[1] != dst]
            plan.disk_load[:] = [p for p in plan.disk_load if p[1] != dst]
            plan.remote_load[:] = [p for p in plan.remote_load if p[1] != dst]
