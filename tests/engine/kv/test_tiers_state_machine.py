"""Hypothesis state machine over the manager with the CPU and disk tiers below it.

Besides the allocators' integrity, it keeps a shadow of what every device block, CPU block and
disk file holds, carries out each step's plan on the shadow in the plan's order, and checks that
what a step's forward reads is exactly the sequence's own KV. That is the hazard rule made
concrete: no spill or swap-in ever reads or writes a block that the same step reuses.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from engine.kv.disk_index import DiskIndex
from engine.kv.hashing import BlockHash
from engine.kv.manager import KVCacheManager
from engine.kv.plan import KVPlan
from engine.kv.tiers import TieredCache
from tests.engine.kv.live_rules import LiveSequenceRules
from tests.engine.kv.test_manager import BS, FakeSeq

NUM_DEVICE = 10
NUM_CPU = 5
NUM_DISK = 8
STEMS = [list(range(i * 4, i * 4 + 4)) for i in range(5)]

Label = object
"""What a block holds: a full block's hash, or (parent hash, tokens) for a partial block."""


def label(seq: FakeSeq, i: int, upto: int) -> Label:
    """What block i of the sequence holds once its first `upto` tokens are computed."""
    tokens = seq.token_ids[i * BS : min((i + 1) * BS, upto)]
    if len(tokens) == BS:
        return seq.block_hashes[i]
    return (seq.block_hashes[i - 1] if i else None, tuple(tokens))


class ShadowDisk:
    """DiskIO over shadow files; a corrupt file fails its probe and is deleted."""

    def __init__(self) -> None:
        self.files: dict[BlockHash, Label] = {}
        self.corrupt: set[BlockHash] = set()
        self.buffer: dict[BlockHash, Label] = {}
        self.enabled = True
        self.num_write_errors = 0
        self.num_refused = 0

    def probe(self, block_hash: BlockHash) -> bool:
        if block_hash in self.buffer:
            return True
        if block_hash in self.corrupt:
            self.corrupt.discard(block_hash)
            self.files.pop(block_hash, None)
            return False
        if block_hash not in self.files:
            return False
        self.buffer[block_hash] = self.files[block_hash]
        return True

    def end_step(self) -> None:
        self.buffer.clear()


class TiersMachine(LiveSequenceRules):
    with_disk = True

    def __init__(self) -> None:
        super().__init__()
        self.disk = ShadowDisk()
        self.tiers = TieredCache(
            NUM_CPU,
            BS,
            disk=DiskIndex(NUM_DISK) if self.with_disk else None,
            disk_io=self.disk if self.with_disk else None,
            max_pinned_fraction=0.4,
        )
        self.kv = KVCacheManager(NUM_DEVICE, BS, max_pinned_fraction=0.3, tiers=self.tiers)
        self.dev: dict[int, Label] = {}
        self.cpu: dict[int, Label] = {}
        self.live: dict[int, FakeSeq] = {}
        """Sequences holding device blocks, all computed up to their last token."""
        self.waiting: dict[int, FakeSeq] = {}
        """Preempted sequences (by swap or recompute), to be resumed or dropped."""
        self.next_id = 0
        self.now = 0.0

    # -- the step ------------------------------------------------------------------------------
    def check_plan(self, plan: KVPlan) -> None:
        spill_dst = [c for _, c in plan.spill]
        fetch_dst = [d for _, d in plan.swap_in] + [d for _, d in plan.disk_load]
        store_src = [c for c, _ in plan.disk_store]
        assert len(set(spill_dst)) == len(spill_dst), "a CPU block is the target of two spills"
        assert len(set(fetch_dst)) == len(fetch_dst), "a device block is fetched into twice"
        assert len(set(store_src)) == len(store_src)
        # A CPU block written to disk is being reused, for a spill; never a swap-in source.
        assert set(store_src) <= set(spill_dst)
        assert not set(store_src) & {c for c, _ in plan.swap_in}

    def execute(self, plan: KVPlan) -> None:
        """Carries the plan out on the shadow, in the runner's order."""
        for c, h in plan.disk_store:
            assert self.cpu.get(c) == h, "disk store of a CPU block that does not hold its hash"
            self.disk.buffer[h] = self.disk.files[h] = self.cpu[c]
        if self.tiers.disk is not None:
            for h in self.tiers.disk.take_deletes():
                self.disk.files.pop(h, None)
        for d, c in plan.spill:
            self.cpu[c] = self.dev.get(d)
        for h, d in plan.disk_load:
            self.dev[d] = self.disk.buffer[h]  # KeyError: a load without verified bytes
        for c, d in plan.swap_in:
            self.dev[d] = self.cpu.get(c)
        for s, d in plan.cow:
            self.dev[d] = self.dev.get(s)

    def run_step(self, scheduled: list[tuple[FakeSeq, int, int]]) -> None:
        plan = self.kv.take_plan()
        self.check_plan(plan)
        self.execute(plan)
        for seq, start, n in scheduled:
            table = self.kv.block_ids(seq.seq_id)
            # The forward reads every computed token before `start` ...
            for i in range(-(-start // BS)):
                assert self.dev.get(table[i]) == label(seq, i, start), (
                    f"block {i} of seq {seq.seq_id}"
                )
            # ... and writes positions [start, start + n).
            for i in range(start // BS, -(-(start + n) // BS)):
                self.dev[table[i]] = label(seq, i, start + n)
        self.kv.end_step()
        for seq, start, n in scheduled:
            seq.num_computed_tokens = start + n
            self.kv.cache_blocks(seq)

    def schedule(self, seq: FakeSeq) -> tuple[FakeSeq, int, int] | None:
        """Admits (or resumes) a sequence with its prefix match, to compute it to the end."""
        match = self.kv.match_prefix(seq)
        assert match.num_tokens < len(seq.token_ids)
        num_new = len(seq.token_ids) - match.num_tokens
        free_before = self.kv.num_free_blocks
        if not self.kv.allocate(seq, num_new, match):
            assert self.kv.num_free_blocks == free_before
            return None
        block_ids = self.kv.block_ids(seq.seq_id)
        num_new -= self.tiers.resume(seq, match.num_blocks, num_new, block_ids, self.kv.plan)
        return (seq, seq.num_computed_tokens, num_new)

    def admit_seq(self, seq: FakeSeq) -> bool:
        item = self.schedule(seq)
        self.run_step([item] if item else [])  # a step without it still releases find's holds
        return item is not None

    def new_seq(self, stems: list[int], tail: int) -> FakeSeq:
        tokens = [t for s in stems for t in STEMS[s]] + list(range(100, 100 + tail))
        seq = FakeSeq(self.next_id, tokens)
        self.next_id += 1
        return seq

    # -- rules ---------------------------------------------------------------------------------
    @rule(stems=st.lists(st.sampled_from(range(5)), min_size=1, max_size=4), tail=st.integers(0, 5))
    def admit(self, stems: list[int], tail: int) -> None:
        seq = self.new_seq(stems, tail)
        if self.admit_seq(seq):
            self.live[seq.seq_id] = seq

    @rule(
        a=st.lists(st.sampled_from(range(5)), min_size=1, max_size=3),
        b=st.lists(st.sampled_from(range(5)), min_size=1, max_size=3),
        tail=st.integers(0, 3),
    )
    def admit_two(self, a: list[int], b: list[int], tail: int) -> None:
        """Two admissions in one step: the second's match and allocation see the first's."""
        items = []
        for stems in (a, b):
            item = self.schedule(self.new_seq(stems, tail))
            if item is not None:
                items.append(item)
        self.run_step(items)
        for seq, _, _ in items:
            self.live[seq.seq_id] = seq

    def decoded(self, seq: FakeSeq) -> None:
        self.run_step([(seq, seq.num_computed_tokens, 1)])

    def decode_stopped(self) -> None:
        self.run_step([])

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """Swap preemption (recompute when the CPU tier cannot take the blocks)."""
        seq = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        # Keep the last token uncomputed, as a running sequence has it (sampled, not yet fed).
        seq.token_ids.append(9)
        seq.block_hashes = FakeSeq(0, seq.token_ids, extra=seq.extra).block_hashes
        cpu_free = self.tiers.cpu.num_free
        swapped = self.tiers.swap_out(seq, self.kv.block_ids(seq.seq_id), self.kv.plan)
        if not swapped:
            assert not self.kv.plan and self.tiers.cpu.num_free == cpu_free
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        self.waiting[seq.seq_id] = seq
        self.run_step([])

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.waiting)))
        seq = self.waiting[sid]
        if self.admit_seq(seq):
            del self.waiting[sid]
            assert sid not in self.tiers.swapped
            self.live[sid] = seq

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def abort_waiting(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.waiting)))
        del self.waiting[sid]
        self.tiers.drop_swap(sid)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), ttl=st.floats(0.5, 5.0))
    def pin(self, data: st.DataObject, ttl: float) -> None:
        seq = self.pick(data)
        if self.kv.pin(seq, len(seq.token_ids), self.now + ttl):
            n_full = len(seq.token_ids) // BS
            self.tiers.pin(seq.block_hashes[:n_full], self.now + ttl)

    @rule(dt=st.floats(0.1, 3.0))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.kv.expire_pins(self.now)
        self.tiers.expire_pins(self.now)

    @precondition(lambda self: bool(self.disk.files))
    @rule(data=st.data())
    def corrupt_file(self, data: st.DataObject) -> None:
        self.disk.corrupt.add(data.draw(st.sampled_from(sorted(self.disk.files))))

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()
        self.tiers.check_integrity()
        for pool in (self.kv.pool, self.tiers.cpu):
            hashes = [b.block_hash for b in pool.blocks if b.block_hash is not None]
            assert len(hashes) == len(set(hashes)), "a hash is findable twice in one tier"
            assert all(b.ref_cnt >= 0 for b in pool.blocks)

    @invariant()
    def contents(self) -> None:
        """Every findable block, in every tier, holds the KV its hash names."""
        for h, b in self.kv.pool.cached.items():
            assert self.dev.get(b.block_id) == h
        for h, b in self.tiers.cpu.cached.items():
            assert self.cpu.get(b.block_id) == h
        if self.tiers.disk is not None:
            for h in self.tiers.disk.entries:
                assert self.disk.files.get(h) == h

    def teardown(self) -> None:
        for seq in list(self.live.values()):
            self.kv.free(seq)
        for sid in list(self.waiting):
            self.tiers.drop_swap(sid)
        self.kv.expire_pins(float("inf"))
        self.tiers.expire_pins(float("inf"))
        assert self.kv.num_free_blocks == NUM_DEVICE
        assert self.tiers.cpu.num_free == NUM_CPU
        assert not self.tiers.swapped
        self.kv.check_integrity()
        self.tiers.check_integrity()


class CpuOnlyMachine(TiersMachine):
    with_disk = False


TestTiers = TiersMachine.TestCase
TestTiers.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCpuOnly = CpuOnlyMachine.TestCase
TestCpuOnly.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
