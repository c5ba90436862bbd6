"""The remote tier's bookkeeping on its own (no network): what a lookup found is loadable and then
dropped, what the write policy queues, what it never writes twice, and its KV events."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from engine.kv.block_pool import BlockPool
from engine.kv.counters import TierCounters
from engine.kv.events import BlockRemoved, BlockStored, KVEventBuffer
from engine.kv.plan import KVPlan
from engine.kv.remote_tier import RemoteTier


class FakeIO:
    """The store's step-thread side, in memory."""

    def __init__(self) -> None:
        self.available = True
        self.buffer: dict[bytes, Any] = {}
        self.loaded_now: list[bytes] = []
        self.written: list[bytes] = []
        self.asked: list[list[bytes]] = []
        self.num_buffered = self.num_refused = self.num_full = self.num_write_errors = 0
        self.num_outages = 0
        self.misses: dict[str, int] = {}

    def lookup(self, hashes: list[bytes]) -> Future[Any]:
        self.asked.append(hashes)
        fut: Future[Any] = Future()
        fut.set_result([])
        return fut

    def accept(self, found: list[tuple[bytes, Any]]) -> None:
        self.buffer.update(found)

    def has(self, h: bytes) -> bool:
        return h in self.buffer

    def loaded(self, h: bytes) -> None:
        self.loaded_now.append(h)

    def end_step(self) -> None:
        for h in self.loaded_now:
            self.buffer.pop(h, None)
        self.loaded_now.clear()

    def take_written(self) -> list[bytes]:
        out, self.written = self.written, []
        return out


def H(i: int) -> bytes:
    return bytes([i]) * 32


def make(policy: str = "write-through") -> tuple[RemoteTier, FakeIO, KVEventBuffer]:
    io, events = FakeIO(), KVEventBuffer(1024, 16)
    return (
        RemoteTier(io, TierCounters(), write_policy=policy, min_hits=2, events=events),
        io,
        events,
    )


def test_found_blocks_load_once_and_a_miss_is_reported_removed() -> None:
    tier, io, events = make()
    tier.prefetch([H(1), H(2), H(3)])
    assert io.asked == [[H(1), H(2), H(3)]]
    tier.accept([H(1), H(2), H(3)], [(H(1), "p1"), (H(2), "p2")])  # H(3): absent
    assert tier.find(H(1)) and tier.find(H(2)) and not tier.find(H(3))
    plan = KVPlan()
    assert tier.fetch(H(1), 7, plan) and not tier.fetch(H(3), 8, plan)
    assert plan.remote_load == [(H(1), 7)] and tier.counters.remote_loads == 1
    tier.end_step()
    assert not tier.find(H(1)) and tier.find(H(2))  # loaded: dropped; the other waits
    assert set(tier.known) == {H(1), H(2)}
    # H(3) was not known: no removal to report; a known hash found absent is reported
    tier.accept([H(2)], [])
    assert events.take()[0] == [BlockRemoved([H(2)], "remote")]


def test_write_through_queues_each_new_block_once_and_resolves_it() -> None:
    tier, io, events = make()
    for h in (H(1), H(2), H(1)):
        tier.on_cached(h)
    cpu = BlockPool(4)
    (blk,) = cpu.allocate(1)
    cpu.cache(blk, H(2))
    writes = tier.take_writes(8, lambda h: 5 if h == H(1) else None, cpu)
    assert writes.from_device == [(5, H(1))] and writes.from_cpu == [(blk.block_id, H(2))]
    tier.on_cached(H(1))  # known now: not queued again
    assert not tier.take_writes(8, lambda h: 5, cpu)
    io.written = [H(1), H(2)]
    tier.end_step()
    assert events.take()[0] == [BlockStored([H(1), H(2)], None, [], 16, "remote")]


def test_a_full_queue_drops_and_a_refused_write_can_come_back() -> None:
    tier, _, _ = make()
    for i in range(3):
        tier.on_cached(H(i))
    writes = tier.take_writes(1, lambda h: 0, None)
    assert len(writes.from_device) == 1 and tier.counters.remote_dropped_writes == 2
    tier.forget_write(H(0))
    tier.on_cached(H(0))
    assert tier.take_writes(1, lambda h: 0, None).from_device == [(0, H(0))]


def test_selective_writes_hit_and_pinned_blocks_only() -> None:
    tier, _, _ = make("selective")
    tier.on_cached(H(1))
    tier.note_hits([H(2)])
    assert not tier.take_writes(8, lambda h: 0, None)
    tier.note_hits([H(2)])  # the second hit
    tier.on_pinned(H(3))
    assert [h for _, h in tier.take_writes(8, lambda h: 0, None).from_device] == [H(2), H(3)]


def test_an_outage_forgets_what_was_written() -> None:
    tier, io, _ = make()
    tier.on_cached(H(1))
    tier.take_writes(8, lambda h: 0, None)
    assert H(1) in tier.known
    io.num_outages = 1  # the store failed: it may come back empty
    tier.end_step()
    assert not tier.known
