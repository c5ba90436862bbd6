"""The remote tier as the tiers' bookkeeping sees it: what was found, what goes there.

Pure Python on block hashes; no torch, no network (the store is engine/kv_io/remote.py's).
`TieredCache` (engine/kv/tiers.py) holds one `RemoteTier` when the engine has a remote tier, below
the disk tier.

Rules:
- Lookups are asynchronous and happen before admission: the engine asks the store for a new
  request's blocks past what this engine holds (`prefetch`), the request waits while others
  step, and the verified payloads of the leading run the store holds are `accept`ed into the
  store's buffer. `find` answers from that buffer only (never the network), so a hit found in a
  step is loadable in that step; a buffered payload planned into a device block is dropped at
  `end_step`.
- Write policies: `write-through` queues every newly computed full device block (`on_cached`);
  `selective` queues blocks once they have been hit `min_hits` times (`note_hits`) and pinned
  hashes. Queued hashes are taken after each step (`take_writes`), resolved to the device or CPU
  block that holds them then and copied into staging memory at once; the store's writer thread
  sends them. A hash this engine wrote or found recently (`known`, bounded) is not queued again.
- KV events (engine/kv/events.py): a hash the store acknowledged is `BlockStored(remote)`; a hash
  a lookup found absent or bad is `BlockRemoved(remote)`. The store's own eviction (TTL,
  maxmemory) is not seen: remote presence is a likelihood, confirmed by a lookup.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

from engine.kv.block_pool import BlockPool
from engine.kv.counters import TierCounters
from engine.kv.events import KVEventBuffer
from engine.kv.hashing import BlockHash
from engine.kv.plan import KVPlan
from engine.kv.write_queue import DiskWrites, WriteQueue
from engine.stats import TierStats

MAX_KNOWN = 1 << 17
"""Hashes remembered as written or found (each ~100 bytes of host memory)."""


class RemoteIO(Protocol):
    """The network side of the remote tier (engine/kv_io/remote.py's RemoteKV)."""

    @property
    def available(self) -> bool: ...

    def lookup(self, hashes: list[BlockHash]) -> Future[Any]: ...

    def accept(self, found: list[tuple[BlockHash, Any]]) -> None: ...

    def has(self, block_hash: BlockHash) -> bool: ...

    def loaded(self, block_hash: BlockHash) -> None: ...

    def end_step(self) -> None: ...

    def take_written(self) -> list[BlockHash]: ...

    @property
    def num_outages(self) -> int: ...

    @property
    def num_buffered(self) -> int: ...

    @property
    def num_refused(self) -> int: ...

    @property
    def num_full(self) -> int: ...

    @property
    def num_write_errors(self) -> int: ...

    @property
    def misses(self) -> Mapping[str, int]: ...


class RemoteTier:
    """The remote store's buffer, write policy and presence guesses below a `TieredCache`."""

    def __init__(
        self,
        io: RemoteIO,
        counters: TierCounters,
        *,
        write_policy: str,
        min_hits: int,
        events: KVEventBuffer | None,
    ) -> None:
        self.io = io
        self.counters = counters
        self.write_policy = write_policy
        self.events = events
        self.known: OrderedDict[BlockHash, None] = OrderedDict()
        """Hashes this engine wrote or found in the store, least recently seen first."""
        self.queue = WriteQueue(self.known.__contains__, min_hits, MAX_KNOWN)
        """Hashes the write policy wants remote, and the selective policy's hit counts."""
        self._outages = 0
        """The store's outages seen: after one, nothing is known to be there any more."""

    # -- lookups -------------------------------------------------------------------------------
    def prefetch(self, hashes: list[BlockHash]) -> Future[Any]:
        """Starts the lookup of these hashes (a prompt's blocks past its local run)."""
        return self.io.lookup(hashes)

    def accept(self, asked: list[BlockHash], found: list[tuple[BlockHash, Any]]) -> None:
        """A lookup of `asked` finished with the payloads of its leading run `found`."""
        self.io.accept(found)
        for h, _ in found:
            self._know(h)
        if len(found) < len(asked):
            missing = asked[len(found)]
            if self.known.pop(missing, 0) is None and self.events is not None:
                self.events.removed(missing, "remote")

    def find(self, block_hash: BlockHash) -> bool:
        return self.io.has(block_hash)

    def fetch(self, block_hash: BlockHash, dst_block_id: int, plan: KVPlan) -> bool:
        """Plans the load of a buffered hit; False when none is buffered."""
        if not self.io.has(block_hash):
            return False
        plan.remote_load.append((block_hash, dst_block_id))
        self.io.loaded(block_hash)
        self.counters.remote_loads += 1
        return True

    def end_step(self) -> None:
        self.io.end_step()
        self.publish_written()

    def publish_written(self) -> None:
        """Reports the values the store acknowledged since the last call as stored "remote";
        each step does, and an idle engine too (acknowledgements arrive after the last step)."""
        if self.io.num_outages != self._outages:
            # NOTE: a store that failed may come back empty (a restart): blocks written
            # before are written again when they are next computed.
            self._outages = self.io.num_outages
            self.known.clear()
        written = self.io.take_written()
        if written and self.events is not None:
            self.events.stored_many(written, "remote")

    # -- the write policy ----------------------------------------------------------------------
    def on_cached(self, block_hash: BlockHash) -> None:
        if self.write_policy == "write-through":
            self.queue.want(block_hash)

    def on_pinned(self, block_hash: BlockHash) -> None:
        self.queue.want(block_hash)

    def note_hits(self, hashes: list[BlockHash]) -> None:
        if self.write_policy == "selective":
            self.queue.count_hits(hashes)

    def take_writes(
        self, room: int, device_lookup: Callable[[BlockHash], int | None], cpu: BlockPool | None
    ) -> DiskWrites:
        """The queued hashes resolved to the blocks that hold them now, `room` at most (the
        writer's free queue slots); the rest are dropped and counted. Between steps only."""
        out, dropped = self.queue.take(room, device_lookup, cpu)
        self.counters.remote_dropped_writes += dropped
        for h in out.hashes():
            self._know(h)
        self.counters.remote_writes += len(out.from_device) + len(out.from_cpu)
        return out

    def forget_write(self, block_hash: BlockHash) -> None:
        """A taken write the store's queue refused: it may be queued again later."""
        self.known.pop(block_hash, None)

    def _know(self, block_hash: BlockHash) -> None:
        self.known[block_hash] = None
        self.known.move_to_end(block_hash)
        while len(self.known) > MAX_KNOWN:
            self.known.popitem(last=False)

    # -- stats ---------------------------------------------------------------------------------
    def stats(self, block_bytes: int) -> TierStats:
        c, io = self.counters, self.io
        return TierStats(
            name="remote",
            used_blocks=io.num_buffered,
            cached_blocks=len(self.known),
            queries=c.remote_queries,
            hits=c.remote_hits,
            swap_ins=c.remote_loads,
            bytes_moved=(c.remote_writes + c.remote_loads) * block_bytes,
            dropped_writes=c.remote_dropped_writes + io.num_refused + io.num_full,
            write_errors=io.num_write_errors,
            disabled=0 if io.available else 1,
            misses=dict(io.misses),
        )
