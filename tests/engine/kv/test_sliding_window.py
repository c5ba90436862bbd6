"""The KV manager with a sliding window (every layer slides over W positions): blocks leave a
sequence once no later query can see them, prefix matches need only the window's blocks; exact
block ids and free-queue order."""

from __future__ import annotations

import pytest

from engine.kv.manager import NULL_BLOCK_ID, KVCacheManager
from engine.kv.tiers import TieredCache
from tests.engine.kv.test_manager import BS, FakeSeq, free_all, run_prefill

W = 6  # a query at p sees keys p - 5 .. p


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def table(kv: KVCacheManager, seq: FakeSeq) -> list[int | None]:
    return [None if b is None else b.block_id for b in kv.tables[seq.seq_id]]


def compute(kv: KVCacheManager, seq: FakeSeq, n: int) -> None:
    """One step computing the sequence's next n tokens (a prefill chunk, or a decode)."""
    assert kv.allocate(seq, n)
    seq.num_computed_tokens += n
    kv.cache_blocks(seq)


def test_blocks_leave_as_the_window_moves() -> None:
    kv = KVCacheManager(16, BS, sliding_window=W)
    seq = FakeSeq(0, list(range(30)))
    compute(kv, seq, 8)  # positions 0-7: nothing outside the window yet
    assert table(kv, seq) == [0, 1]
    compute(kv, seq, 8)  # queries from 8 see keys >= 3: block 0 still needed
    assert table(kv, seq) == [0, 1, 2, 3]
    assert free_ids(kv) == list(range(4, 16))
    # queries from 16 see keys >= 11: blocks 0 (0-3) and 1 (4-7) go, tail first; block 2
    # (8-11) stays for key 11
    compute(kv, seq, 4)
    assert table(kv, seq) == [None, None, 2, 3, 4]
    assert free_ids(kv) == [*range(5, 16), 1, 0]
    assert kv.block_ids(0) == [NULL_BLOCK_ID, NULL_BLOCK_ID, 2, 3, 4]
    # released blocks keep their hashes: the prefix cache still finds them
    assert kv.pool.lookup(seq.block_hashes[0]) is kv.pool.blocks[0]
    assert kv.num_held_blocks(0) == 3
    compute(kv, seq, 1)  # decode at 20: keys >= 15, block 3 (12-15) stays
    assert table(kv, seq) == [None, None, None, 3, 4, 5]
    compute(kv, seq, 1)  # decode at 21: keys >= 16
    assert table(kv, seq) == [None, None, None, None, 4, 5]
    assert free_ids(kv) == [*range(6, 16), 1, 0, 2, 3]
    kv.check_integrity()
    kv.free(seq)
    assert free_ids(kv) == [*range(6, 16), 1, 0, 2, 3, 5, 4]
    assert kv.num_free_blocks == 16
    kv.check_integrity()


def test_long_sequence_holds_window_plus_one_block() -> None:
    """2,048 tokens, window 256, blocks of 16, chunks of 256 then decode: a sequence never holds
    more than the window's blocks plus one (plus a chunk's while it prefills)."""
    kv = KVCacheManager(200, 16, sliding_window=256)
    seq = FakeSeq(0, list(range(2048 + 64)))
    seq.block_hashes = []  # hashing 2k tokens in a 4-token-block test helper is not the point
    peak_prefill = 0
    while seq.num_computed_tokens < 2048:
        compute(kv, seq, 256)
        peak_prefill = max(peak_prefill, kv.num_held_blocks(0))
    peak_decode = 0
    for _ in range(64):
        compute(kv, seq, 1)
        peak_decode = max(peak_decode, kv.num_held_blocks(0))
    assert peak_decode == 256 // 16 + 1
    assert peak_prefill == (256 + 256) // 16
    assert kv.num_blocks - kv.num_free_blocks == kv.num_held_blocks(0)
    kv.check_integrity()


def test_prefix_match_skips_blocks_outside_the_window() -> None:
    kv = KVCacheManager(16, BS, sliding_window=W)
    a = FakeSeq(0, list(range(21)))
    assert run_prefill(kv, a)  # 6 blocks, all computed at once and cached
    assert table(kv, a) == [0, 1, 2, 3, 4, 5]
    kv.free(a)
    # Same 21 tokens: 5 full blocks may match (never the last token). The next query sits at
    # 20 and sees keys >= 15: only blocks 3 and 4 are needed; blocks 0-2 are skipped.
    b = FakeSeq(1, list(range(21)))
    match = kv.match_prefix(b)
    assert match.num_skipped == 3
    assert [blk.block_id for blk in match.device_blocks] == [3, 4]
    assert match.num_tokens == 20
    assert match.tokens_by_tier() == {"device": 20, "cpu": 0, "disk": 0, "remote": 0}
    assert kv.blocks_needed(b, 1, match) == 2 + 1  # the two free hits plus the new tail block
    assert kv.allocate(b, 1, match)
    assert table(kv, b) == [None, None, None, 3, 4, 6]
    assert b.num_computed_tokens == 20 and b.num_cached_blocks == 5
    kv.check_integrity()


def test_prefix_match_survives_evicted_leading_blocks() -> None:
    """A long sequence's leading blocks leave it first, so they are reused first; its last
    window's blocks are still cached: a window match still covers the whole prefix, where a
    full-prefix match would find nothing (block 0's hash is gone)."""
    kv = KVCacheManager(8, BS, sliding_window=W)
    a = FakeSeq(0, list(range(24)))
    compute(kv, a, 8)
    compute(kv, a, 8)
    compute(kv, a, 8)  # from 16: keys >= 11, blocks 0 and 1 leave
    other = FakeSeq(1, list(range(100, 116)))
    assert run_prefill(kv, other)
    assert table(kv, other) == [6, 7, 1, 0]  # a's first two blocks reused
    kv.free(a)
    b = FakeSeq(2, [*range(24), 999])
    assert kv.pool.lookup(b.block_hashes[0]) is None
    assert kv.pool.lookup(b.block_hashes[1]) is None
    match = kv.match_prefix(b)
    # next query at 24 sees keys >= 19: blocks 4 (16-19) and 5 (20-23)
    got = (match.num_tokens, match.num_skipped, [x.block_id for x in match.device_blocks])
    assert got == (24, 4, [4, 5])
    assert kv.allocate(b, 1, match)
    assert table(kv, b) == [None, None, None, None, 4, 5, 3]
    kv.check_integrity()


def test_fork_and_free_with_released_entries() -> None:
    kv = KVCacheManager(16, BS, sliding_window=W)
    a = FakeSeq(0, list(range(18)))
    compute(kv, a, 16)
    compute(kv, a, 2)  # released: blocks 0, 1
    assert table(kv, a) == [None, None, 2, 3, 4]
    child = FakeSeq(1, list(a.token_ids))
    child.num_computed_tokens = a.num_computed_tokens
    kv.fork(a, child)
    assert [kv.pool.blocks[i].ref_cnt for i in (2, 3, 4)] == [2, 2, 2]
    # the child's decode copies the shared partial tail on write and releases its own refs
    child.token_ids.append(7)
    compute(kv, child, 1)  # at 18: keys >= 13, block 2 (8-11) goes for the child only
    assert table(kv, child) == [None, None, None, 3, 5]
    assert kv.take_plan().cow == [(4, 5)]
    assert [kv.pool.blocks[i].ref_cnt for i in (2, 3, 4)] == [1, 2, 1]
    kv.check_integrity()
    free_all(kv, a, child)


def test_window_match_through_the_cpu_tier() -> None:
    """Device misses, CPU hits: only the window's blocks are swapped in."""
    tiers = TieredCache(16, BS)
    kv = KVCacheManager(6, BS, sliding_window=W, tiers=tiers)
    a = FakeSeq(0, list(range(17)))
    assert run_prefill(kv, a)  # 5 blocks of 6
    kv.free(a)
    kv.take_plan()
    tiers.end_step()
    filler = FakeSeq(1, list(range(100, 124)))  # 6 blocks: evicts (spills) all of a's
    assert run_prefill(kv, filler)
    spills = kv.take_plan().spill
    assert len(spills) == 4  # a's 4 full blocks go to the CPU tier (the partial tail does not)
    tiers.end_step()
    kv.free(filler)
    b = FakeSeq(2, list(range(17)))
    match = kv.match_prefix(b)
    # next query at 16 sees keys >= 11: blocks 2 (8-11) and 3 (12-15) are fetched, 0-1 skipped
    assert match.num_skipped == 2 and match.device_blocks == []
    assert [tier for tier, _ in match.lower_hits] == ["cpu", "cpu"]
    assert [h for _, h in match.lower_hits] == b.block_hashes[2:4]
    assert match.tokens_by_tier() == {"device": 0, "cpu": 16, "disk": 0, "remote": 0}
    assert kv.allocate(b, 1, match)
    assert len(kv.take_plan().swap_in) == 2
    assert kv.tables[2][:2] == [None, None]
    tiers.end_step()
    kv.check_integrity()


def test_bad_window() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(4, BS, sliding_window=0)
