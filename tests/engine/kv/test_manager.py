"""The device-tier allocator: exact block ids, eviction order, copy-on-write, hashing."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.kv.block_pool import BlockPool
from engine.kv.hashing import extra_keys, hash_block, hash_blocks
from engine.kv.manager import KVCacheManager

BS = 4
EXTRA = extra_keys("m")


@dataclass
class FakeSeq:
    seq_id: int
    token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0
    extra: bytes = EXTRA

    def __post_init__(self) -> None:
        self.block_hashes = hash_blocks(self.token_ids, BS, self.extra)


def run_prefill(kv: KVCacheManager, seq: FakeSeq) -> bool:
    """Admits a sequence with its prefix match and computes its whole prompt."""
    match = kv.match_prefix(seq)
    ok = kv.allocate(seq, len(seq.token_ids) - match.num_tokens, match)
    if ok:
        seq.num_computed_tokens = len(seq.token_ids)
        kv.cache_blocks(seq)
    return ok


def free_all(kv: KVCacheManager, *seqs: FakeSeq) -> None:
    """Frees `seqs`, then checks that every block of the pool is free and the pool is whole."""
    for seq in seqs:
        kv.free(seq)
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def test_hash_is_stable_and_chained() -> None:
    h1 = hash_block(None, [1, 2, 3, 4], EXTRA)
    # A fixed value: the same in every process and on every machine (no salted `hash()`).
    assert h1.hex() == "1ee8afdd3903425b5e6b738749a5026eb6ca75a73f11a81325c0a498a7b906d8"
    assert len(h1) == 32
    assert hash_block(h1, [5, 6, 7, 8], EXTRA) != hash_block(None, [5, 6, 7, 8], EXTRA)
    assert hash_block(None, [1, 2, 3, 4], extra_keys("m", "tenant-a")) != h1
    assert hash_block(None, [1, 2, 3, 4], extra_keys("other")) != h1
    chain = hash_blocks(list(range(10)), 4, EXTRA)
    assert len(chain) == 2  # the partial tail is not hashed
    assert chain[1] == hash_block(chain[0], [4, 5, 6, 7], EXTRA)
    assert hash_blocks(list(range(10)), 4, EXTRA, parent=chain[0], start_block=1) == chain[1:]


def test_hash_known_value() -> None:
    # A literal: guards the canonical encoding (a change would orphan every disk tier and
    # desynchronise the router from the replicas).
    assert hash_block(None, [1, 2, 3], extra_keys("m")).hex() == (
        "504a3e9ebb206dde77dc540a77d74ed05c0b2807a014721b93841a2af841698f"
    )


def test_allocate_exact_ids_and_lru_order() -> None:
    kv = KVCacheManager(8, BS)
    a = FakeSeq(0, list(range(10)))  # 3 blocks: 2 full + 1 partial
    assert run_prefill(kv, a)
    assert kv.block_ids(0) == [0, 1, 2]
    b = FakeSeq(1, list(range(100, 106)))  # 2 blocks
    assert run_prefill(kv, b)
    assert kv.block_ids(1) == [3, 4]
    kv.free(a)  # tail first: 2, 1, 0 join the queue in that order after 5, 6, 7
    assert [blk.block_id for blk in kv.pool.free_queue] == [5, 6, 7, 2, 1, 0]
    kv.free(b)
    assert [blk.block_id for blk in kv.pool.free_queue] == [5, 6, 7, 2, 1, 0, 4, 3]
    kv.check_integrity()


def test_prefix_hit_reuses_blocks_and_never_covers_last_token() -> None:
    kv = KVCacheManager(8, BS)
    a = FakeSeq(0, list(range(8)))  # exactly 2 full blocks
    assert run_prefill(kv, a)
    kv.free(a)
    again = FakeSeq(1, list(range(8)))
    m = kv.match_prefix(again)
    # Only the first block: the last token must be computed.
    assert [b.block_id for b in m.device_blocks] == [0]
    longer = FakeSeq(2, list(range(9)))
    assert [b.block_id for b in kv.match_prefix(longer).device_blocks] == [0, 1]
    assert kv.allocate(longer, 1, kv.match_prefix(longer))
    assert kv.block_ids(2) == [0, 1, 2]
    assert longer.num_computed_tokens == 8
    kv.check_integrity()


def test_salt_separates_caches() -> None:
    kv = KVCacheManager(8, BS)
    a = FakeSeq(0, list(range(9)))
    assert run_prefill(kv, a)
    other = FakeSeq(1, list(range(9)), extra=extra_keys("m", "tenant-b"))
    other.__post_init__()
    assert kv.match_prefix(other).num_tokens == 0
    same = FakeSeq(2, list(range(9)))
    assert kv.match_prefix(same).num_tokens == 8


def test_eviction_order_is_lru_and_tail_first() -> None:
    kv = KVCacheManager(4, BS)
    a = FakeSeq(0, [*list(range(8)), 99])  # blocks 0,1 full (cached), 2 partial
    assert run_prefill(kv, a)
    kv.free(a)  # queue: 3, 2, 1, 0
    evicted: list[int] = []
    kv.pool.on_evict = lambda blk, h: evicted.append(blk.block_id)
    c = FakeSeq(1, list(range(200, 212)))  # 3 blocks, no hit
    assert kv.match_prefix(c).num_tokens == 0
    assert run_prefill(kv, c)
    assert kv.block_ids(1) == [3, 2, 1]
    # Block 1 (a's second full block) was cached: evicted before block 0, its head.
    assert evicted == [1]
    assert kv.pool.lookup(a.block_hashes[0]) is kv.pool.blocks[0]
    assert kv.pool.lookup(a.block_hashes[1]) is None
    kv.check_integrity()


def test_hit_on_free_block_moves_it_out_of_queue() -> None:
    kv = KVCacheManager(4, BS)
    a = FakeSeq(0, list(range(5)))
    assert run_prefill(kv, a)
    kv.free(a)
    b = FakeSeq(1, list(range(6)))
    assert run_prefill(kv, b)
    assert kv.block_ids(1) == [0, 2]
    assert [blk.block_id for blk in kv.pool.free_queue] == [3, 1]
    kv.check_integrity()


def test_allocate_is_all_or_nothing() -> None:
    kv = KVCacheManager(3, BS)
    a = FakeSeq(0, list(range(8)))
    assert run_prefill(kv, a)
    big = FakeSeq(1, list(range(50, 62)))
    before = [blk.block_id for blk in kv.pool.free_queue]
    assert not kv.allocate(big, 12)
    assert [blk.block_id for blk in kv.pool.free_queue] == before
    assert kv.block_ids(1) == []
    kv.check_integrity()


def test_fork_copy_on_write() -> None:
    kv = KVCacheManager(8, BS)
    parent = FakeSeq(0, list(range(6)))  # block 0 full, block 1 partial (2 tokens)
    assert run_prefill(kv, parent)
    child = FakeSeq(1, list(range(6)))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert kv.block_ids(1) == [0, 1]
    assert kv.pool.blocks[1].ref_cnt == 2
    # The child appends into the shared partial block: it gets a copy.
    child.token_ids.append(7)
    assert kv.allocate(child, 1)
    assert kv.block_ids(1) == [0, 2]
    plan = kv.take_plan()
    assert plan.cow == [(1, 2)]
    # The parent now holds the partial block alone: no copy.
    parent.token_ids.append(8)
    assert kv.allocate(parent, 1)
    assert kv.block_ids(0) == [0, 1]
    assert not kv.take_plan().cow
    kv.check_integrity()
    free_all(kv, parent, child)


def test_counters_and_reset() -> None:
    kv = KVCacheManager(8, BS)
    a = FakeSeq(0, list(range(9)))
    m = kv.match_prefix(a)
    kv.record_admission(9, m)
    assert run_prefill(kv, a)
    b = FakeSeq(1, list(range(9)))
    m = kv.match_prefix(b)
    kv.record_admission(9, m)
    assert kv.counters.device_queries == 18
    assert kv.counters.device_hits == 8
    assert not kv.reset()  # a holds blocks
    kv.free(a)
    assert kv.reset()
    assert kv.match_prefix(b).num_tokens == 0
    kv.check_integrity()


def test_pins_hold_blocks_until_ttl_and_respect_cap() -> None:
    kv = KVCacheManager(8, BS, max_pinned_fraction=0.25)  # at most 2 pinned blocks
    a = FakeSeq(0, list(range(9)))
    assert run_prefill(kv, a)
    assert kv.pin(a, 9, until=10.0)
    kv.free(a)
    assert kv.num_free_blocks == 6
    kv.check_integrity()
    b = FakeSeq(1, list(range(50, 63)))
    assert run_prefill(kv, b)
    assert not kv.pin(b, 13, until=10.0)  # over the cap: nothing pinned
    kv.expire_pins(5.0)
    assert len(kv.pins) == 2
    kv.expire_pins(10.0)
    assert not kv.pins
    free_all(kv, b)


def test_double_free_is_refused() -> None:
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(ValueError, match="double free"):
        pool.free([blk])
