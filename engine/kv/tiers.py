"""The tiers below the device pool: a CPU tier of host blocks and the disk tier's index.

Pure Python on integer block ids and hashes; no torch, no file I/O (engine/kv_io/offload.py carries the
plans out and reads the files). `TieredCache` implements the `LowerTiers` protocol of
`KVCacheManager`.

Rules:
- Write-back spill: when the device tier reuses a cached block, the block is first copied to the
  CPU tier (`KVPlan.spill`) unless the CPU tier already holds its hash (then that CPU block only
  moves to the most recently used end of the CPU LRU).
- The CPU tier is a `BlockPool` with its own hash index and LRU. A CPU block's ref count is the sum
  of: one step reference (see below), one per swapped-out sequence that holds it, one for a pin.
- Step references: a CPU block that is a spill target, a swap-in source, or was found by `find`
  holds one reference until `end_step`, so no later op of the same step reuses it (the hazard
  rule of `KVPlan`). `find` holding what it finds also guarantees that a hit is still there when
  the manager fetches it, after allocating device blocks (whose spills may evict CPU blocks).
- Disk tier: when the CPU tier reuses a cached block, a disk store is planned first
  (`KVPlan.disk_store`) unless the disk index already holds the hash. The index has a budget in
  blocks and evicts by least recent access; evicted files are deleted by the store.
- NOTE: disk hits are verified in `find`: `DiskIO.probe` reads the file and checks its checksum
  into a read buffer that lives until `end_step`, so a corrupt, truncated or vanished file is a
  miss before the manager commits to it, and the runner's disk load copies from that buffer and
  cannot fail. A hash whose disk store is planned in the same step is a hit without a probe: the
  store snapshots the CPU block before any load of the step.
- A device block that is a fetch destination of this step is never spilled when it is reused in
  the same step (its bytes have not arrived; the source tier still holds the hash), and a second
  fetch into the same device block in one step supersedes the first.
- Preemption by swap: `swap_out` plans spills of a sequence's computed blocks (full blocks under
  their hashes, shared with the prefix cache; the partial tail in a private block with no hash)
  and holds them until `resume` or `drop_swap`. The sequence comes back through the prefix cache
  (its full blocks are CPU or device hits); `resume` swaps the private tail in.
- Pins: a pinned hash keeps its CPU block (now or when it arrives) out of eviction until the TTL
  passes; at most `max_pinned` hashes are pinned.
- Write policies (what reaches disk besides nothing): `write-back` stores CPU blocks about to be
  reused (the rule above); `write-through` also queues every newly computed full device block
  (`on_cached`); `selective` queues blocks once they have been hit `min_hits` times
  (`note_hits`) and pinned hashes, and its write-back stores only such blocks. Queued hashes are
  taken by the engine after each step (`take_writes`), resolved to the device or CPU block that
  holds them then, and copied into staging memory at once (the writer thread does the I/O). A hash
  the disk index holds is never queued: each hash is written once across tiers.
- A disk tier whose files failed (read-only or full directory) is off: `find` stops probing and
  nothing more is queued (engine/kv_io/disk.py turns it off, with a warning and a counter).
- KV events (`events`, engine/kv/events.py): a hash entering the CPU tier (spill, swap-out,
  warm start) is `BlockStored(cpu)`, one leaving it `BlockRemoved(cpu)`; the disk index reports
  its own; a disk tier that turned itself off reports all its hashes removed at `end_step`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.kv.block_pool import Block, BlockPool
from engine.kv.counters import TierCounters
from engine.kv.disk_index import DiskIndex
from engine.kv.events import KVEventBuffer
from engine.kv.hashing import BlockHash
from engine.kv.plan import KVPlan
from engine.stats import TierStats

WRITE_POLICIES = ("write-through", "selective", "write-back")


class DiskIO(Protocol):
    """The file side of the disk tier (engine/kv_io/disk.py)."""

    @property
    def enabled(self) -> bool:
        """False once the tier turned itself off (its directory failed a write)."""
        ...

    @property
    def num_write_errors(self) -> int:
        """Writes that failed (the first one turns the tier off)."""
        ...

    @property
    def num_refused(self) -> int:
        """Stores refused because the writer's queue was full."""
        ...

    def probe(self, block_hash: BlockHash) -> bool:
        """Reads and verifies the block's file into the step's read buffer.

        False when the file is missing or bad (a bad file is deleted).
        """
        ...

    def end_step(self) -> None:
        """Drops the step's read buffer."""
        ...


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
class DiskWrites:
    """Blocks to copy into staging memory now and queue for the disk writer (`take_writes`)."""

    from_device: list[tuple[int, BlockHash]] = field(default_factory=list)
    """(device block id, hash)."""
    from_cpu: list[tuple[int, BlockHash]] = field(default_factory=list)
    """(cpu block id, hash)."""

    def __bool__(self) -> bool:
        return bool(self.from_device or self.from_cpu)


@dataclass(slots=True)
class _Step:
    """Transient state of the step being planned; cleared by `end_step`."""

    refs: list[Block] = field(default_factory=list)
    """CPU blocks holding one step reference, in the order taken."""
    held: set[int] = field(default_factory=set)
    """Ids of those blocks."""
    fetch_dst: set[int] = field(default_factory=set)
    """Device blocks this step's plan fills from a lower tier."""
    disk_found: set[BlockHash] = field(default_factory=set)
    """Hashes whose file `find` verified in this step (bytes in the read buffer)."""
    disk_stores: set[BlockHash] = field(default_factory=set)
    """Hashes whose disk store this step's plan carries."""
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
    ) -> None:
        if (disk is None) != (disk_io is None):
            raise ValueError("the disk tier needs both its index and its file reader")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.write_policy = write_policy
        self.min_hits = min_hits
        self.block_size = block_size
        self.cpu = BlockPool(num_cpu_blocks, on_evict=self._on_cpu_evict)
        self.disk = disk
        self.disk_io = disk_io
        self.counters = TierCounters()
        """Shared with the KVCacheManager this cache sits below (it counts the lookups)."""
        self.swapped: dict[int, SwapRecord] = {}
        """seq_id -> the CPU blocks of a sequence preempted by swap."""
        self.max_pinned = int(max_pinned_fraction * num_cpu_blocks)
        self.pins: dict[BlockHash, float] = {}
        """hash -> expiry of its pin."""
        self._pinned_blocks: dict[BlockHash, Block] = {}
        """Pinned hashes present in the CPU tier -> their block (holding one reference)."""
        self._step = _Step()
        self._plan: KVPlan | None = None
        """The plan that CPU evictions append disk stores to, set while allocating CPU blocks."""
        self._writes: dict[BlockHash, None] = {}
        """Hashes the write policy wants on disk, in order; taken by `take_writes`."""
        self._hits: OrderedDict[BlockHash, int] = OrderedDict()
        """Prefix hits per hash (selective policy), least recently hit first, bounded."""
        self._max_hit_entries = max(4096, 8 * num_cpu_blocks)
        self.events = events
        """Where CPU-tier stores and removals are reported (the disk index reports its own)."""
        self._disk_reported_on = disk is not None
        """The disk tier was on at the last `end_step` (its turning off is reported once)."""
        if disk is not None and events is not None:
            disk.events = events

    # -- LowerTiers ----------------------------------------------------------------------------
    def find(self, block_hash: BlockHash) -> str | None:
        """The tier holding the hash ("cpu" before "disk") or None.

        NOTE: a CPU hit is held until `end_step` and a disk hit's bytes are read and verified
        now, so a hit found in a step can be fetched in that step whatever else it evicts.
        """
        step = self._step
        b = self.cpu.lookup(block_hash)
        if b is not None and b.block_id not in step.spill_dst:
            self._hold_for_step(b)
            return "cpu"
        if self.disk is None or self.disk_io is None or not self.disk_io.enabled:
            return None
        if block_hash in step.disk_stores or block_hash in step.disk_found:
            return "disk"
        # NOTE: probed even when the index lacks the hash: replicas sharing the directory
        # write files this index has not seen (a miss costs one failed open).
        if self.disk_io.probe(block_hash):
            self.disk.add(block_hash)
            step.disk_found.add(block_hash)
            return "disk"
        self.disk.discard(block_hash)
        return None

    def fetch(self, block_hash: BlockHash, dst_block_id: int, plan: KVPlan) -> None:
        """Plans the copy of a hit found in this step into device block `dst_block_id`."""
        step = self._step
        self._supersede(dst_block_id, plan)
        b = self.cpu.lookup(block_hash)
        if b is not None and b.block_id not in step.spill_dst:
            self._hold_for_step(b)
            plan.swap_in.append((b.block_id, dst_block_id))
            self.counters.cpu_swap_ins += 1
        elif self.disk is not None and (
            block_hash in step.disk_found or block_hash in step.disk_stores
        ):
            self.disk.touch(block_hash)
            plan.disk_load.append((block_hash, dst_block_id))
            self.counters.disk_loads += 1
        else:
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
        c = self._alloc_cpu(plan)
        if c is None:
            self.counters.dropped_spills += 1
            return
        self.cpu.cache(c, block_hash)
        if self.events is not None:
            self.events.stored_one(block_hash, "cpu")
        self._hold_new_for_step(c)
        plan.spill.append((block_id, c.block_id))
        self._step.spill_dst.add(c.block_id)
        self.counters.device_spills += 1
        if block_hash in self.pins:
            self._pin_hold(block_hash)

    def end_step(self) -> None:
        """The step's plan has been carried out: release its CPU references and read buffer."""
        step, self._step = self._step, _Step()
        self.cpu.free(step.refs)
        if self.disk_io is not None:
            self.disk_io.end_step()
            if self._disk_reported_on and not self.disk_io.enabled and self.disk is not None:
                self._disk_reported_on = False
                if self.events is not None:
                    self.events.removed_many(list(self.disk.entries), "disk")

    def on_cached(self, block_hash: BlockHash) -> None:
        """A newly computed full device block: write-through queues it for disk."""
        if self.write_policy == "write-through" and self._disk_on():
            self._want_write(block_hash)

    def note_hits(self, hashes: list[BlockHash]) -> None:
        """Counts prefix hits; under `selective` a hash reaching `min_hits` is queued for disk."""
        if self.write_policy != "selective" or not self._disk_on():
            return
        counts = self._hits
        for h in hashes:
            n = counts.pop(h, 0) + 1
            counts[h] = n
            if n == self.min_hits:
                self._want_write(h)
        while len(counts) > self._max_hit_entries:
            counts.popitem(last=False)

    # -- the write policy's disk writes --------------------------------------------------------
    def take_writes(
        self, room: int, device_lookup: Callable[[BlockHash], int | None]
    ) -> DiskWrites:
        """The queued hashes resolved to the block that holds them now (device first, then CPU),
        at most `room` of them (the writer's free queue slots); the rest are dropped and counted.

        Call between steps (no plan pending): every cached block then holds its hash's bytes.
        Each taken hash enters the disk index now (its payload is readable from the writer's
        queue until the file exists).
        NOTE: not when the file is renamed into place: the index is the step thread's and this
        is what keeps a hash from being queued twice. A write that then fails turns the whole
        tier off (lookups stop, `cached_hashes` skips the index), and a restart rebuilds the
        index from the files that exist, so such an entry is never served.
        """
        out = DiskWrites()
        queued, self._writes = self._writes, {}
        if self.disk is None or not self._disk_on():
            return out
        for h in queued:
            if h in self.disk:
                continue
            if room <= 0:
                self.counters.dropped_writes += 1
                continue
            dev = device_lookup(h)
            if dev is not None:
                out.from_device.append((dev, h))
            else:
                b = self.cpu.lookup(h)
                if b is None:  # evicted from both before the step ended: nothing to write
                    self.counters.dropped_writes += 1
                    continue
                out.from_cpu.append((b.block_id, h))
            self.disk.add(h)
            self.counters.disk_writes += 1
            room -= 1
        return out

    def forget_write(self, block_hash: BlockHash) -> None:
        """A taken write did not reach the writer (refused there, and counted there)."""
        if self.disk is not None:
            self.disk.remove(block_hash)

    # -- warm start and republishing -----------------------------------------------------------
    def warm_target(self, block_hash: BlockHash) -> int | None:
        """A CPU block to fill with this disk block's bytes at warm start, now cached under its
        hash and free (in the LRU), or None when the hash is present or no never-used block is
        left (warm start never evicts)."""
        if self.cpu.lookup(block_hash) is not None:
            return None
        if (
            self.cpu.num_free == 0
            or len(self.cpu.cached) + self.cpu.num_used >= self.cpu.num_blocks
        ):
            return None
        head = next(iter(self.cpu.free_queue), None)
        if head is None or head.block_hash is not None:
            return None
        (b,) = self.cpu.allocate(1)
        self.cpu.cache(b, block_hash)
        self.cpu.free([b])
        if self.events is not None:
            self.events.stored_one(block_hash, "cpu")
        self.counters.warm_blocks += 1
        return b.block_id

    def cached_hashes(self, limit: int) -> list[BlockHash]:
        """Up to `limit` hashes the CPU then disk tiers hold, most recently used first."""
        out: list[BlockHash] = []
        seen: set[BlockHash] = set()
        cpu_order = [b.block_hash for b in self.cpu.free_queue if b.block_hash is not None]
        held = [b.block_hash for b in self.cpu.blocks if b.ref_cnt and b.block_hash is not None]
        sources: list[Iterable[BlockHash]] = [held, reversed(cpu_order)]
        if self.disk is not None and self._disk_on():
            sources.append(reversed(self.disk.entries))
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
        if self.disk is not None and self._disk_on():
            out.append(("disk", list(self.disk.entries)))
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
                b = self._alloc_cpu(plan)
                assert b is not None
                h = seq.block_hashes[i]
                self.cpu.cache(b, h)
                if self.events is not None:
                    self.events.stored_one(h, "cpu")
                plan.spill.append((device_block_ids[i], b.block_id))
                self._step.spill_dst.add(b.block_id)
                self.counters.device_spills += 1
                if h in self.pins:
                    self._pin_hold(h)
            blocks.append(b)
        if tail:
            t = self._alloc_cpu(plan)
            assert t is not None
            plan.spill.append((device_block_ids[num_full], t.block_id))
            self._step.spill_dst.add(t.block_id)
            self.counters.device_spills += 1
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
        for b in rec.blocks:
            if b.block_id in self._step.held:
                self.cpu.free([b])  # it already holds a step reference
            else:
                self._hold_new_for_step(b)  # the swap's reference becomes the step's
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
        new = {h for h in hashes if h not in self.pins}
        if len(self.pins) + len(new) > self.max_pinned:
            return False
        for h in hashes:
            self.pins[h] = max(until, self.pins.get(h, 0.0))
            self._pin_hold(h)
            if self.write_policy != "write-back" and self._disk_on():
                self._want_write(h)  # a pinned prefix is worth keeping across restarts
        return True

    def expire_pins(self, now: float) -> None:
        expired = [h for h, t in self.pins.items() if t <= now]
        for h in expired:
            del self.pins[h]
            b = self._pinned_blocks.pop(h, None)
            if b is not None:
                self.cpu.free([b])

    # -- stats and checks ----------------------------------------------------------------------
    def add_stats(self, tiers: list[TierStats], block_bytes: int) -> None:
        """Fills the device tier's spill figures and appends the cpu and disk tiers' stats."""
        c = self.counters
        for t in tiers:
            if t.name == "device":
                t.spills = c.device_spills
                t.bytes_moved = (c.device_spills + c.cpu_swap_ins + c.disk_loads) * block_bytes
        cpu = self.cpu
        tiers.append(
            TierStats(
                name="cpu",
                num_blocks=cpu.num_blocks,
                # cached blocks + the private tails of swapped-out sequences
                used_blocks=len(cpu.cached)
                + sum(1 for r in self.swapped.values() if r.tail_tokens),
                cached_blocks=len(cpu.cached),
                pinned_blocks=len(self._pinned_blocks),
                queries=c.cpu_queries,
                hits=c.cpu_hits,
                spills=c.disk_stores,
                swap_ins=c.cpu_swap_ins,
                evictions=cpu.num_evictions,
                bytes_moved=(c.device_spills + c.cpu_swap_ins + c.disk_stores) * block_bytes,
            )
        )
        if self.disk is not None:
            tiers.append(
                TierStats(
                    name="disk",
                    num_blocks=self.disk.capacity,
                    used_blocks=len(self.disk),
                    cached_blocks=len(self.disk),
                    queries=c.disk_queries,
                    hits=c.disk_hits,
                    swap_ins=c.disk_loads,
                    evictions=self.disk.num_evictions + self.disk.num_discarded,
                    bytes_moved=(c.disk_stores + c.disk_writes + c.disk_loads) * block_bytes,
                    dropped_writes=c.dropped_writes
                    + (self.disk_io.num_refused if self.disk_io else 0),
                    write_errors=self.disk_io.num_write_errors if self.disk_io else 0,
                    disabled=0 if self._disk_on() else 1,
                )
            )

    def check_integrity(self) -> None:
        """CPU pool integrity, and every CPU reference accounted for by a step, swap or pin."""
        self.cpu.check_integrity()
        refs = [0] * self.cpu.num_blocks
        for b in self._step.refs:
            refs[b.block_id] += 1
        if len(self._step.refs) != len(self._step.held):
            raise AssertionError("a CPU block holds two step references")
        for rec in self.swapped.values():
            for b in rec.blocks:
                refs[b.block_id] += 1
        for h, b in self._pinned_blocks.items():
            if b.block_hash != h:
                raise AssertionError(f"pinned {b} lost its hash")
            refs[b.block_id] += 1
        for b in self.cpu.blocks:
            if refs[b.block_id] != b.ref_cnt:
                raise AssertionError(
                    f"CPU {b} has ref_cnt {b.ref_cnt} but {refs[b.block_id]} holders"
                )
        if len(self.pins) > self.max_pinned:
            raise AssertionError("more pinned hashes than the cap")

    # -- internals -----------------------------------------------------------------------------
    def _hold_for_step(self, b: Block) -> None:
        if b.block_id not in self._step.held:
            self.cpu.touch([b])
            self._step.held.add(b.block_id)
            self._step.refs.append(b)

    def _hold_new_for_step(self, b: Block) -> None:
        """Turns a reference the caller already took into the block's step reference."""
        assert b.block_id not in self._step.held
        self._step.held.add(b.block_id)
        self._step.refs.append(b)

    def _alloc_cpu(self, plan: KVPlan) -> Block | None:
        """One CPU block (ref 1), evicting the least recently used cached one; None if all held."""
        if self.cpu.num_free == 0:
            return None
        self._plan = plan
        try:
            (b,) = self.cpu.allocate(1)
        finally:
            self._plan = None
        return b

    def _on_cpu_evict(self, block: Block, block_hash: BlockHash) -> None:
        if block_hash in self._pinned_blocks:
            raise AssertionError(f"pinned CPU {block} reached the free queue")
        if self.events is not None:
            self.events.removed(block_hash, "cpu")
        if self.disk is None or not self._disk_on():
            return
        if block_hash in self.disk:
            self.disk.touch(block_hash)
            return
        if self.write_policy == "selective" and not self._is_hot(block_hash):
            return
        assert self._plan is not None, "CPU blocks are only reused while planning"
        self.disk.add(block_hash)
        self._step.disk_stores.add(block_hash)
        self._plan.disk_store.append((block.block_id, block_hash))
        self.counters.disk_stores += 1

    def _disk_on(self) -> bool:
        return self.disk is not None and self.disk_io is not None and self.disk_io.enabled

    def _want_write(self, block_hash: BlockHash) -> None:
        if self.disk is not None and block_hash not in self.disk:
            self._writes[block_hash] = None

    def _is_hot(self, block_hash: BlockHash) -> bool:
        return self._hits.get(block_hash, 0) >= self.min_hits or block_hash in self.pins

    def _supersede(self, dst: int, plan: KVPlan) -> None:
        """A fetch into `dst` replaces an earlier fetch into it in the same step."""
        if dst in self._step.fetch_dst:
            plan.swap_in[:] = [p for p in plan.swap_in if p[1] != dst]
            plan.disk_load[:] = [p for p in plan.disk_load if p[1] != dst]

    def _pin_hold(self, block_hash: BlockHash) -> None:
        if block_hash in self._pinned_blocks:
            return
        b = self.cpu.lookup(block_hash)
        if b is not None:
            self.cpu.touch([b])
            self._pinned_blocks[block_hash] = b
