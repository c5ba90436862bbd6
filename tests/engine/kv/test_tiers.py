"""The CPU tier and the disk index below the device pool: exact spill, swap-in and disk plans."""

from __future__ import annotations

from engine.kv.disk_index import DiskIndex
from engine.kv.hashing import BlockHash
from engine.kv.manager import KVCacheManager
from engine.kv.plan import KVPlan
from engine.kv.tiers import TieredCache
from tests.engine.kv.test_manager import BS, FakeSeq, run_prefill


class FakeDisk:
    """DiskIO over a set of "files"; `bad` files fail verification (and are deleted)."""

    def __init__(self) -> None:
        self.files: set[BlockHash] = set()
        self.bad: set[BlockHash] = set()
        self.probes: list[BlockHash] = []
        self.enabled = True
        self.num_write_errors = 0
        self.num_refused = 0

    def probe(self, block_hash: BlockHash) -> bool:
        self.probes.append(block_hash)
        if block_hash in self.bad:
            self.bad.discard(block_hash)
            self.files.discard(block_hash)
            return False
        return block_hash in self.files

    def end_step(self) -> None:
        pass

    def apply(self, plan: KVPlan, deletes: list[BlockHash]) -> None:
        self.files |= {h for _, h in plan.disk_store}
        self.files -= set(deletes)


def make(
    num_device: int, num_cpu: int, disk_blocks: int | None = None, pinned: float = 0.5
) -> tuple[KVCacheManager, TieredCache, FakeDisk]:
    disk = FakeDisk()
    index = DiskIndex(disk_blocks) if disk_blocks else None
    tiers = TieredCache(
        num_cpu,
        BS,
        disk=index,
        disk_io=disk if index is not None else None,
        max_pinned_fraction=pinned,
    )
    kv = KVCacheManager(num_device, BS, tiers=tiers)
    return kv, tiers, disk


def step(kv: KVCacheManager, tiers: TieredCache, disk: FakeDisk | None = None) -> KVPlan:
    """Ends a step the way the engine does: take the plan, "carry it out", release."""
    plan = kv.take_plan()
    if disk is not None and tiers.disk is not None:
        disk.apply(plan, tiers.disk.take_deletes())
    kv.end_step()
    return plan


def serve(
    kv: KVCacheManager, tiers: TieredCache, seq: FakeSeq, disk: FakeDisk | None = None
) -> KVPlan:
    """Prefills `seq`, ends the step and frees it (its full blocks stay cached); the step's plan."""
    assert run_prefill(kv, seq)
    plan = step(kv, tiers, disk)
    kv.free(seq)
    return plan


def check(kv: KVCacheManager, tiers: TieredCache) -> None:
    kv.check_integrity()
    tiers.check_integrity()


def test_write_back_spill_and_swap_in_exact_ids() -> None:
    kv, tiers, _ = make(4, 4)
    a = FakeSeq(0, [*range(8), 99])  # blocks 0, 1 full (cached), 2 partial
    assert not serve(kv, tiers, a)  # queue: 3, 2, 1, 0
    c = FakeSeq(1, list(range(200, 212)))  # 3 full blocks, no hit
    assert run_prefill(kv, c)
    assert kv.block_ids(1) == [3, 2, 1]
    plan = step(kv, tiers)
    # Block 1 held a's second block: spilled to CPU block 0 before its reuse.
    assert plan.spill == [(1, 0)] and not plan.swap_in
    assert tiers.cpu.lookup(a.block_hashes[1]) is tiers.cpu.blocks[0]
    assert tiers.cpu.blocks[0].ref_cnt == 0  # the step reference ended with the step
    check(kv, tiers)

    kv.free(c)  # queue: 0, 1, 2, 3 (1, 2, 3 hold c's hashes)
    d = FakeSeq(2, [*range(8), 99])
    m = kv.match_prefix(d)
    assert [b.block_id for b in m.device_blocks] == [0]
    assert m.lower_hits == [("cpu", a.block_hashes[1])]
    assert m.tokens_by_tier() == {"device": 4, "cpu": 4, "disk": 0, "remote": 0}
    assert kv.allocate(d, 1, m)
    assert kv.block_ids(2) == [0, 1, 2]
    plan = step(kv, tiers)
    # Device blocks 1 and 2 held c's third and second blocks: spilled to CPU 1 and 2; then a's
    # second block comes back from CPU block 0 into device block 1.
    assert plan.spill == [(1, 1), (2, 2)]
    assert plan.swap_in == [(0, 1)]
    assert tiers.counters.device_spills == 3 and tiers.counters.cpu_swap_ins == 1
    check(kv, tiers)
    kv.free(d)
    assert kv.num_free_blocks == 4
    check(kv, tiers)


def test_no_spill_when_cpu_already_holds_the_hash() -> None:
    kv, tiers, _ = make(3, 4)
    serve(kv, tiers, FakeSeq(0, [*range(8), 99]))  # queue: 2, 1, 0
    assert serve(kv, tiers, FakeSeq(1, list(range(100, 112)))).spill == [(1, 0), (0, 1)]
    again = FakeSeq(2, [*range(8), 99])
    assert run_prefill(kv, again)  # both full blocks are CPU hits
    plan = step(kv, tiers)
    # a's blocks 0 and 1 sit in CPU blocks 1 and 0; they come back into device blocks 0 and 1,
    # whose hashes (b's) spill to CPU 2 and 3; device block 2 (b's first) finds every CPU block
    # held in this step, so its spill is dropped.
    assert plan.swap_in == [(1, 0), (0, 1)]
    assert plan.spill == [(0, 2), (1, 3)]
    assert tiers.counters.dropped_spills == 1
    kv.free(again)  # queue: 2, 1, 0
    # a's blocks are reused again but the CPU tier still has both hashes: no new copies.
    assert serve(kv, tiers, FakeSeq(3, list(range(100, 112)))).spill == []
    check(kv, tiers)


def test_cpu_eviction_plans_disk_store_then_disk_hit_loads() -> None:
    kv, tiers, disk = make(2, 1, disk_blocks=8)
    a = FakeSeq(0, [*range(4), 99])  # block 0 full, 1 partial
    serve(kv, tiers, a, disk)  # queue: 1, 0
    # b takes 1, 0: a's block 0 spills to CPU 0.
    b = FakeSeq(1, [*range(100, 104), 99])
    assert serve(kv, tiers, b, disk).spill == [(0, 0)]  # queue: 0, 1 (1 holds b's full block)
    c = FakeSeq(2, [*range(200, 204), 99])
    assert run_prefill(kv, c)
    plan = step(kv, tiers, disk)
    # b's block must go to CPU 0, which holds a's block: a's block is written to disk first.
    assert plan.disk_store == [(0, a.block_hashes[0])]
    assert plan.spill == [(1, 0)]
    assert a.block_hashes[0] in disk.files and a.block_hashes[0] in tiers.disk  # type: ignore[operator]
    kv.free(c)
    d = FakeSeq(3, [*range(4), 7, 7])
    m = kv.match_prefix(d)
    assert m.lower_hits == [("disk", a.block_hashes[0])]
    assert kv.allocate(d, 2, m)
    plan = step(kv, tiers, disk)
    assert plan.disk_load == [(a.block_hashes[0], kv.block_ids(3)[0])]
    assert tiers.counters.disk_loads == 1 and tiers.counters.disk_stores >= 1
    kv.free(d)
    check(kv, tiers)


def test_corrupt_disk_file_is_a_clean_miss() -> None:
    kv, tiers, disk = make(2, 1, disk_blocks=8)
    h = FakeSeq(0, [*range(4), 99]).block_hashes[0]
    assert tiers.disk is not None
    tiers.disk.add(h)
    disk.files.add(h)
    disk.bad.add(h)
    d = FakeSeq(1, [*range(4), 99])
    assert kv.match_prefix(d).num_tokens == 0
    assert h not in tiers.disk and tiers.disk.num_discarded == 1
    assert not serve(kv, tiers, d, disk).disk_load
    check(kv, tiers)


def test_disk_store_of_the_same_step_is_a_hit_without_probe() -> None:
    tiers = TieredCache(1, BS, disk=DiskIndex(4), disk_io=FakeDisk())
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    plan = KVPlan()
    tiers.on_device_evict(5, h1, plan)
    tiers.end_step()
    tiers.on_device_evict(6, h2, plan)  # CPU block 0 holds h1: it goes to disk first
    assert plan.disk_store == [(0, h1)] and plan.spill == [(5, 0), (6, 0)]
    assert tiers.find(h1) == "disk"
    tiers.fetch(h1, 9, plan)
    assert plan.disk_load == [(h1, 9)]
    tiers.end_step()
    tiers.check_integrity()


def test_found_cpu_hit_is_held_through_the_step() -> None:
    kv, tiers, _ = make(3, 1)
    a = FakeSeq(0, [*range(4), 99])
    serve(kv, tiers, a)  # queue: 2, 1, 0
    b = FakeSeq(1, list(range(100, 112)))  # 3 full blocks: takes 2, 1, 0, spills a's block 0
    assert serve(kv, tiers, b).spill == [(0, 0)]  # queue: 0, 1, 2, all cached with b's blocks
    d = FakeSeq(2, [*range(4), 5, 6])
    m = kv.match_prefix(d)
    assert m.lower_hits == [("cpu", a.block_hashes[0])]
    assert kv.allocate(d, 2, m)
    plan = step(kv, tiers)
    # Device block 0, taken for the hit itself, holds b's third block: its spill would need the
    # only CPU block, which is the hit found by match_prefix and held since. Both spills (of
    # device blocks 0 and 1) are dropped rather than overwrite the block being swapped in.
    assert kv.block_ids(2) == [0, 1]
    assert plan.swap_in == [(0, 0)]
    assert plan.spill == []
    assert tiers.counters.dropped_spills == 2
    kv.free(d)
    check(kv, tiers)


def test_fetch_destination_is_not_spilled_and_refetch_supersedes() -> None:
    tiers = TieredCache(4, BS)
    h1, h2, h3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    plan = KVPlan()
    tiers.on_device_evict(0, h1, plan)
    tiers.on_device_evict(1, h2, plan)
    tiers.end_step()
    plan = KVPlan()
    assert tiers.find(h1) == "cpu" and tiers.find(h2) == "cpu"
    tiers.fetch(h1, 7, plan)
    # Device block 7 is reused in the same step: its bytes have not arrived, so no spill ...
    tiers.on_device_evict(7, h1, plan)
    tiers.on_device_evict(7, h3, plan)
    assert plan.spill == []
    # ... and a second fetch into it replaces the first.
    tiers.fetch(h2, 7, plan)
    assert plan.swap_in == [(1, 7)]
    tiers.end_step()
    tiers.check_integrity()


def running(kv: KVCacheManager, num_tokens: int) -> FakeSeq:
    """Sequence 0 with tokens 0..num_tokens-1, all computed but the last (a running sequence's
    sampled token is not yet fed), its full blocks cached."""
    s = FakeSeq(0, list(range(num_tokens)))
    assert kv.allocate(s, num_tokens - 1)
    s.num_computed_tokens = num_tokens - 1
    kv.cache_blocks(s)
    return s


def test_swap_out_and_resume_exact_ids() -> None:
    kv, tiers, _ = make(6, 4)
    s = running(kv, 11)  # computed 10: blocks 0, 1 full, 2 holds 2 tokens
    step(kv, tiers)
    assert tiers.swap_out(s, kv.block_ids(0), kv.plan)
    kv.free(s)
    s.num_computed_tokens = 0
    plan = step(kv, tiers)
    assert plan.spill == [(0, 0), (1, 1), (2, 2)]
    assert [b.ref_cnt for b in tiers.cpu.blocks] == [1, 1, 1, 0]  # held for the sequence
    check(kv, tiers)
    # Other traffic takes every device block (their hashes are already in the CPU tier).
    serve(kv, tiers, FakeSeq(1, list(range(100, 124))))
    # It comes back: the full blocks are CPU hits, the tail is swapped in, 1 token is computed.
    m = kv.match_prefix(s)
    assert m.lower_hits == [("cpu", s.block_hashes[0]), ("cpu", s.block_hashes[1])]
    assert kv.allocate(s, 11 - 8, m)
    assert tiers.resume(s, m.num_blocks, 3, kv.block_ids(0), kv.plan) == 2
    assert s.num_computed_tokens == 10
    ids = kv.block_ids(0)
    plan = step(kv, tiers)
    assert plan.swap_in == [(0, ids[0]), (1, ids[1]), (2, ids[2])]
    assert tiers.swapped == {}
    assert [b.ref_cnt for b in tiers.cpu.blocks] == [0, 0, 0, 0]
    kv.free(s)
    check(kv, tiers)


def test_swap_out_falls_back_when_cpu_is_full() -> None:
    kv, tiers, _ = make(6, 2)
    s = running(kv, 11)
    assert not tiers.swap_out(s, kv.block_ids(0), kv.plan)  # needs 3 CPU blocks
    assert not kv.take_plan() and tiers.swapped == {}
    tiers.drop_swap(0)  # no-op
    kv.free(s)
    check(kv, tiers)


def test_drop_swap_releases_cpu_blocks() -> None:
    kv, tiers, _ = make(6, 4)
    s = running(kv, 6)
    assert tiers.swap_out(s, kv.block_ids(0), kv.plan)
    kv.free(s)
    step(kv, tiers)
    tiers.drop_swap(0)
    assert all(b.ref_cnt == 0 for b in tiers.cpu.blocks)
    # The full block stays cached in the CPU tier; the private tail is just free.
    assert tiers.cpu.lookup(s.block_hashes[0]) is not None and len(tiers.cpu.cached) == 1
    check(kv, tiers)


def test_cpu_pins_survive_pressure_until_ttl_and_respect_the_cap() -> None:
    tiers = TieredCache(2, BS, max_pinned_fraction=0.5)
    h = [bytes([i]) * 32 for i in range(1, 6)]
    plan = KVPlan()
    tiers.on_device_evict(0, h[0], plan)
    tiers.end_step()
    assert tiers.pin([h[0]], until=10.0)
    assert not tiers.pin([h[1]], until=10.0)  # cap: 1 of 2 blocks
    for i, x in enumerate(h[1:4]):
        tiers.on_device_evict(i, x, plan)
        tiers.end_step()
    assert tiers.cpu.lookup(h[0]) is not None  # pinned: never evicted
    assert tiers.cpu.lookup(h[1]) is None and tiers.cpu.lookup(h[3]) is not None
    tiers.check_integrity()
    tiers.expire_pins(now=10.0)
    assert not tiers.pins
    tiers.on_device_evict(0, h[4], plan)  # the released pin went to the LRU tail
    tiers.end_step()
    assert tiers.cpu.lookup(h[0]) is not None and tiers.cpu.lookup(h[3]) is None
    tiers.on_device_evict(1, h[1], plan)
    tiers.end_step()
    assert tiers.cpu.lookup(h[0]) is None  # evictable again
    tiers.check_integrity()


def test_pin_applies_to_a_hash_when_it_arrives() -> None:
    tiers = TieredCache(2, BS, max_pinned_fraction=1.0)
    h1, h2, h3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    assert tiers.pin([h1], until=5.0)
    plan = KVPlan()
    tiers.on_device_evict(0, h1, plan)
    tiers.end_step()
    tiers.on_device_evict(1, h2, plan)
    tiers.end_step()
    tiers.on_device_evict(2, h3, plan)
    tiers.end_step()
    assert tiers.cpu.lookup(h1) is not None and tiers.cpu.lookup(h2) is None
    tiers.check_integrity()


def test_disk_index_lru_budget() -> None:
    idx = DiskIndex(2)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    idx.add(a)
    idx.add(b)
    idx.touch(a)
    idx.add(c)  # b is the least recently accessed
    assert list(idx.entries) == [a, c] and idx.take_deletes() == [b]
    idx.add(b)  # re-added: b's pending delete (none now) and a evicted
    assert idx.take_deletes() == [a]
    idx.discard(c)
    assert list(idx.entries) == [b] and idx.num_discarded == 1 and idx.num_evictions == 2
