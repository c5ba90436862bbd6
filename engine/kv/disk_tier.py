"""The disk tier as the tiers' bookkeeping sees it: its index, its file reader, its write policy.

Pure Python on block hashes; no torch, no file I/O (the files are engine/kv_io/disk.py's).
`TieredCache` (engine/kv/tiers.py) holds one `DiskTier` when the engine has a disk tier and asks
it what is on disk and what goes there.

Rules:
- Write-back store: when the CPU tier reuses a cached block, a disk store is planned first
  (`KVPlan.disk_store`) unless the disk index already holds the hash. The index has a budget in
  blocks and evicts by least recent access; evicted files are deleted by the store.
- NOTE: disk hits are verified in `find`: `DiskIO.probe` reads the file and checks its checksum
  into a read buffer that lives until `end_step`, so a corrupt, truncated or vanished file is a
  miss before the manager commits to it, and the runner's disk load copies from that buffer and
  cannot fail. A hash whose disk store is planned in the same step is a hit without a probe: the
  store snapshots the CPU block before any load of the step.
- Write policies (what reaches disk besides nothing): `write-back` stores CPU blocks about to be
  reused (the rule above); `write-through` also queues every newly computed full device block
  (`on_cached`); `selective` queues blocks once they have been hit `min_hits` times
  (`note_hits`) and pinned hashes, and its write-back stores only such blocks. Queued hashes are
  taken by the engine after each step (`take_writes`), resolved to the device or CPU block that
  holds them then, and copied into staging memory at once (the writer thread does the I/O). A hash
  the disk index holds is never queued: each hash is written once across tiers.
- A disk tier whose files failed (read-only or full directory) is off: `find` stops probing and
  nothing more is queued (engine/kv_io/disk.py turns it off, with a warning and a counter).
- KV events (engine/kv/events.py): the disk index reports the hashes entering and leaving it; a
  disk tier that turned itself off reports all its hashes removed at `end_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.kv.block_pool import BlockPool
from engine.kv.counters import TierCounters
from engine.kv.disk_index import DiskIndex
from engine.kv.events import KVEventBuffer
from engine.kv.hashing import BlockHash
from engine.kv.plan import KVPlan
from engine.kv.write_queue import DiskWrites, WriteQueue
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


class DiskTier:
    """The disk index, the file reader and the write policy below a `TieredCache`."""

    def __init__(
        self,
        index: DiskIndex,
        io: DiskIO,
        counters: TierCounters,
        *,
        write_policy: str,
        min_hits: int,
        max_hit_entries: int,
        events: KVEventBuffer | None,
    ) -> None:
        self.index = index
        self.io = io
        self._found: set[BlockHash] = set()
        """Hashes whose file `find` verified in this step (bytes in the read buffer)."""
        self._stores: set[BlockHash] = set()
        """Hashes whose disk store this step's plan carries."""
        self.write_policy = write_policy
        """One of WRITE_POLICIES: what reaches disk besides write-back stores."""
        self.queue = WriteQueue(self.index.__contains__, min_hits, max_hit_entries)
        """Hashes the write policy wants on disk, and the selective policy's hit counts."""
        self.counters = counters
        """The `TieredCache`'s (shared with its manager)."""
        self.events = events
        if events is not None:
            index.events = events
        self._reported_on = True
        """The tier was on at the last `end_step` (its turning off is reported once)."""

    @property
    def enabled(self) -> bool:
        return self.io.enabled

    # -- lookups and loads ---------------------------------------------------------------------
    def find(self, block_hash: BlockHash) -> bool:
        """Whether the tier holds the hash, its bytes verified in this step's read buffer."""
        if not self.io.enabled:
            return False
        if block_hash in self._stores or block_hash in self._found:
            return True
        # NOTE: probed even when the index lacks the hash: replicas sharing the directory
        # write files this index has not seen (a miss costs one failed open).
        if self.io.probe(block_hash):
            self.index.add(block_hash)
            self._found.add(block_hash)
            return True
        self.index.discard(block_hash)
        return False

    def fetch(self, block_hash: BlockHash, dst_block_id: int, plan: KVPlan) -> bool:
        """Plans the load of a hit `find` returned in this step; False when it returned none."""
        if block_hash not in self._found and block_hash not in self._stores:
            return False
        self.index.touch(block_hash)
        plan.disk_load.append((block_hash, dst_block_id))
        self.counters.disk_loads += 1
        return True

    def end_step(self) -> None:
        """Drops the step's hits and read buffer; reports a tier that turned off as emptied."""
        self._found.clear()
        self._stores.clear()
        self.io.end_step()
        if self._reported_on and not self.io.enabled:
            self._reported_on = False
            if self.events is not None:
                self.events.removed_many(list(self.index.entries), "disk")

    # -- the write policy ----------------------------------------------------------------------
    def on_cpu_evict(
        self, cpu_block_id: int, block_hash: BlockHash, plan: KVPlan | None, *, pinned: bool
    ) -> None:
        """A cached CPU block is about to be reused: plans its store (write-back) unless the index
        holds the hash or the policy does not want it. `plan`: the plan being built."""
        if not self.io.enabled:
            return
        if block_hash in self.index:
            self.index.touch(block_hash)
            return
        q = self.queue
        if self.write_policy == "selective" and not (q.hits(block_hash) >= q.min_hits or pinned):
            return
        assert plan is not None, "CPU blocks are only reused while planning"
        self.index.add(block_hash)
        self._stores.add(block_hash)
        plan.disk_store.append((cpu_block_id, block_hash))
        self.counters.disk_stores += 1

    def on_cached(self, block_hash: BlockHash) -> None:
        """A newly computed full device block: write-through queues it."""
        if self.write_policy == "write-through" and self.io.enabled:
            self.queue.want(block_hash)

    def on_pinned(self, block_hash: BlockHash) -> None:
        """A pinned hash: every policy but write-back queues it (a pinned prefix is worth keeping
        across restarts)."""
        if self.write_policy != "write-back" and self.io.enabled:
            self.queue.want(block_hash)

    def note_hits(self, hashes: list[BlockHash]) -> None:
        """Counts prefix hits; under `selective` a hash reaching `min_hits` is queued."""
        if self.write_policy == "selective" and self.io.enabled:
            self.queue.count_hits(hashes)

    def take_writes(
        self, room: int, device_lookup: Callable[[BlockHash], int | None], cpu: BlockPool
    ) -> DiskWrites:
        """The queued hashes resolved to the block that holds them now (device first, then the
        `cpu` tier), at most `room` of them (the writer's free queue slots); the rest are dropped
        and counted.

        Call between steps (no plan pending): every cached block then holds its hash's bytes.
        Each taken hash enters the disk index now (its payload is readable from the writer's
        queue until the file exists).
        NOTE: not when the file is renamed into place: the index is the step thread's and this
        is what keeps a hash from being queued twice. A write that then fails turns the whole
        tier off (lookups stop, `cached_hashes` skips the index), and a restart rebuilds the
        index from the files that exist, so such an entry is never served.
        """
        if not self.io.enabled:
            self.queue.clear()
            return DiskWrites()
        out, dropped = self.queue.take(room, device_lookup, cpu)
        self.counters.dropped_writes += dropped
        for h in out.hashes():
            self.index.add(h)
        self.counters.disk_writes += len(out.from_device) + len(out.from_cpu)
        return out

    # -- stats ---------------------------------------------------------------------------------
    def stats(self, block_bytes: int) -> TierStats:
        c = self.counters
        index = self.index
        return TierStats(
            name="disk",
            num_blocks=index.capacity,
            used_blocks=len(index),
            cached_blocks=len(index),
            queries=c.disk_queries,
            hits=c.disk_hits,
            swap_ins=c.disk_loads,
            evictions=index.num_evictions + index.num_discarded,
            bytes_moved=(c.disk_stores + c.disk_writes + c.disk_loads) * block_bytes,
            dropped_writes=c.dropped_writes + self.io.num_refused,
            write_errors=self.io.num_write_errors,
            disabled=0 if self.io.enabled else 1,
        )
