"""Hypothesis state machine over the device-tier allocator: integrity after every step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from engine.kv.manager import KVCacheManager
from tests.engine.kv.live_rules import LiveSequenceRules
from tests.engine.kv.test_manager import BS, FakeSeq

NUM_BLOCKS = 12
# A small alphabet of prompt "stems" so that prompts share prefixes and hit the cache.
STEMS = [list(range(i * 4, i * 4 + 4)) for i in range(4)]


class AllocatorMachine(LiveSequenceRules):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, max_pinned_fraction=0.25)
        self.live: dict[int, FakeSeq] = {}
        self.next_id = 0
        self.now = 0.0

    @rule(stems=st.lists(st.sampled_from(range(4)), min_size=1, max_size=4), tail=st.integers(0, 5))
    def admit(self, stems: list[int], tail: int) -> None:
        tokens = [t for s in stems for t in STEMS[s]] + list(range(100, 100 + tail))
        seq = FakeSeq(self.next_id, tokens)
        self.next_id += 1
        free_before = self.kv.num_free_blocks
        match = self.kv.match_prefix(seq)
        assert match.num_tokens < len(tokens)
        ok = self.kv.allocate(seq, len(tokens) - match.num_tokens, match)
        if ok:
            seq.num_computed_tokens = len(tokens)
            self.kv.cache_blocks(seq)
            self.live[seq.seq_id] = seq
        else:
            assert self.kv.num_free_blocks == free_before

    def decoded(self, seq: FakeSeq) -> None:
        seq.num_computed_tokens += 1
        self.kv.cache_blocks(seq)
        self.kv.take_plan()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), ttl=st.floats(0.5, 5.0))
    def pin(self, data: st.DataObject, ttl: float) -> None:
        seq = self.pick(data)
        pinned_before = len(self.kv.pins)
        if not self.kv.pin(seq, len(seq.token_ids), self.now + ttl):
            assert len(self.kv.pins) == pinned_before
        assert len(self.kv.pins) <= self.kv.max_pinned

    @rule(dt=st.floats(0.1, 3.0))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.kv.expire_pins(self.now)

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()
        pool = self.kv.pool
        assert pool.num_free + pool.num_used == NUM_BLOCKS

    def teardown(self) -> None:
        for seq in list(self.live.values()):
            self.kv.free(seq)
        self.kv.expire_pins(float("inf"))
        assert self.kv.num_free_blocks == NUM_BLOCKS
        self.kv.check_integrity()


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class SlidingAllocatorMachine(AllocatorMachine):
    """The same rules with a sliding window of 5 positions: blocks leave sequences as they
    decode, prefix matches skip blocks outside the window."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, max_pinned_fraction=0.25, sliding_window=5)

    @invariant()
    def released_only_outside_the_window(self) -> None:
        for seq in self.live.values():
            released = self.kv.num_released.get(seq.seq_id, 0)
            # a query of the sequence's next step (from num_computed_tokens) sees none of them
            assert released <= self.kv.num_outside_window(seq.num_computed_tokens)
            assert all(b is None for b in self.kv.tables[seq.seq_id][:released])


TestSlidingAllocator = SlidingAllocatorMachine.TestCase
TestSlidingAllocator.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
