"""The replica agent's KV-event record writer: netted per block, batched in time, retried."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping, Sequence

from engine.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVSnapshot,
)
from engine.kv.hashing import BlockHash
from engine.stats import EngineStats
from service.affinity import AffinityConfig, AffinityStoreError, ReplicaInfo
from service.affinity.memory import MemoryAffinityStore
from service.replica.agent import ReplicaAgent
from service.replica.kv_events import KvBatch, KvEventRing
from service.replica.kv_records import KvRecordWriter
from tests.support.waiting import wait_until

H = [bytes([i]) * 32 for i in range(256)]


class CountingStore(MemoryAffinityStore):
    """The memory store, counting the prefix writes asked of it; `fail_writes` next
    `write_prefixes` calls fail as an unreachable store's would."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.written: list[dict[BlockHash, str | None]] = []
        self.fail_writes = 0

    async def write_prefixes(
        self, replica_id: str, tiers: Mapping[BlockHash, str | None], ttl_s: float
    ) -> None:
        self.writes += 1
        if self.fail_writes:
            self.fail_writes -= 1
            raise AffinityStoreError("injected")
        self.written.append(dict(tiers))
        await super().write_prefixes(replica_id, tiers, ttl_s)

    async def record_prefix(
        self, replica_id: str, block_hashes: Sequence[BlockHash], ttl_s: float, tier: str = "device"
    ) -> None:
        self.writes += 1
        await super().record_prefix(replica_id, block_hashes, ttl_s, tier)

    async def remove_prefix(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> None:
        self.writes += 1
        await super().remove_prefix(replica_id, block_hashes)

    async def clear_prefixes(self, replica_id: str) -> None:
        self.writes += 1
        await super().clear_prefixes(replica_id)

    async def tiers(self, hashes: Sequence[BlockHash]) -> list[int | None]:
        """Each block's tier index in r1's records (None: no record), one block at a time."""
        out: list[int | None] = []
        for h in hashes:
            t = (await self.longest_prefix_tiers([h])).get("r1")
            out.append(None if t is None else t.index(1))
        return out


async def attempt(op: str, call: Awaitable[None]) -> bool:
    try:
        await call
        return True
    except AffinityStoreError:
        return False


def writer(store: CountingStore, max_pending: int = 1024) -> KvRecordWriter:
    return KvRecordWriter(
        store, "r1", attempt, ttl_s=60, flush_s=0.01, retry_s=0.01, max_pending=max_pending
    )


def stored(hashes: list[BlockHash], medium: str = "device") -> BlockStored:
    return BlockStored(hashes, None, [], 16, medium)


def removed(hashes: list[BlockHash], medium: str = "device") -> BlockRemoved:
    return BlockRemoved(hashes, medium)


def batch(seq: int, *events: KVEvent) -> KvBatch:
    return KvBatch(seq, 0.0, list(events))


async def test_changes_are_netted_per_block() -> None:
    store = CountingStore()
    w = writer(store)
    w.apply(batch(1, stored([H[0], H[1], H[2]])))
    w.apply(batch(2, removed([H[1]])))  # stored and removed before a flush: never written
    w.apply(batch(3, stored([H[0]], "cpu"), removed([H[0]])))  # spilled to the CPU tier
    w.apply(batch(4, stored([H[2]], "disk")))  # the device copy still wins
    assert await w.flush()
    assert store.writes == 1
    assert store.written == [{H[0]: "cpu", H[2]: "device"}]
    assert await store.tiers(H[:3]) == [1, None, 0]

    # Back where the store already is: nothing to write.
    w.apply(batch(5, stored([H[0]]), removed([H[2]])))
    w.apply(batch(6, removed([H[0]]), stored([H[2]])))
    assert w.num_pending == 0 and await w.flush()
    assert store.writes == 1
    assert w.last_sequence_number == 6 and w.num_held == 2


async def test_a_failed_write_is_retried_not_lost() -> None:
    store = CountingStore()
    w = writer(store)
    w.apply(batch(1, stored([H[0], H[1]])))
    store.fail_writes = 1
    assert not await w.flush()
    assert w.num_pending == 2
    # Back to what the failed write wanted: still written, the store's state is unknown.
    w.apply(batch(2, removed([H[1]])))
    w.apply(batch(3, stored([H[1]])))
    w.apply(batch(4, stored([H[2]], "cpu")))
    assert await w.flush()
    assert await store.tiers(H[:3]) == [0, 0, 1]
    assert store.writes == 2


async def test_a_clear_drops_what_a_failed_write_wanted() -> None:
    store = CountingStore()
    await store.record_prefix("r1", [H[9]], ttl_s=60)  # a stale record of an earlier life
    w = writer(store)
    w.apply(batch(1, stored([H[0]])))
    store.fail_writes = 1
    assert not await w.flush()
    w.apply(batch(2, AllBlocksCleared(), stored([H[1]], "disk")))
    assert await w.flush()
    assert await store.tiers([H[0], H[1], H[9]]) == [None, 2, None]


async def test_too_many_pending_changes_start_over_from_what_is_held() -> None:
    store = CountingStore()
    w = writer(store, max_pending=4)
    w.apply(batch(1, stored(H[:20])))
    assert await w.flush()
    w.apply(batch(2, removed(H[2:20])))  # 18 removals pending: past the bound
    assert w.num_pending == w.num_held == 2
    assert await w.flush()  # a clear, then the held blocks
    assert store.writes == 3
    assert await store.tiers(H[:4]) == [0, 0, None, None]


async def test_a_burst_of_steps_costs_few_writes() -> None:
    store = CountingStore()
    ring = KvEventRing(lambda: _empty_snapshot(), capacity=1024)
    info = ReplicaInfo("r1", "127.0.0.1:1", "m", 16)
    config = AffinityConfig(prefix_flush_s=0.1, heartbeat_s=0.05, replica_ttl_s=1.0)
    agent = ReplicaAgent(
        store, info, EngineStats, config, capacity_blocks=1, kv_events=ring.subscribe
    )
    await agent.start()
    await wait_until(lambda: ring.num_snapshots == 1, what="the agent subscribed")
    await wait_until(lambda: store.writes == 1, what="the snapshot's clear written")
    registered = (await store.list_replicas())[0].updated_at

    # 200 engine steps, one every millisecond or so: each stores a block and drops the
    # previous step's block from the device (it spills to the CPU tier or, every 4th, is gone).
    t0 = time.monotonic()
    for i in range(1, 201):
        events: list[KVEvent] = [stored([H[i]])]
        if i > 1:
            events.append(removed([H[i - 1]]))
            if (i - 1) % 4:
                events.append(stored([H[i - 1]], "cpu"))
        ring.publish(KVEventBatch(i, time.time(), events))
        await asyncio.sleep(0.001)
    elapsed = time.monotonic() - t0

    want = [None if j % 4 == 0 else 1 for j in range(1, 200)] + [0]

    async def all_written() -> bool:
        return await store.tiers(H[1:201]) == want

    await wait_until(all_written, what="the burst's final state in the store")
    writes = store.writes - 1
    # One write per flush interval the burst spanned (and one after it), not one per step.
    assert writes <= elapsed / config.prefix_flush_s + 2, (writes, elapsed)
    assert writes < 40
    assert agent.kv_records.last_sequence_number == ring.last_sequence_number
    assert ring.num_snapshots == 1
    assert (await store.list_replicas())[0].updated_at > registered  # heartbeats went on
    await agent.stop()
    ring.close()


async def _empty_snapshot() -> KVSnapshot:
    return KVSnapshot(0, [])
