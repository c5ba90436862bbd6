"""Rules both allocator state machines share: decoding, forking and freeing a live sequence."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from engine.kv.manager import KVCacheManager
from tests.engine.kv.test_manager import FakeSeq


class LiveSequenceRules(RuleBasedStateMachine):
    """A machine whose subclass sets `kv`, `live` (seq id -> sequence) and `next_id`."""

    kv: KVCacheManager
    live: dict[int, FakeSeq]
    next_id: int

    def pick(self, data: st.DataObject) -> FakeSeq:
        """A live sequence, drawn by id."""
        return self.live[data.draw(st.sampled_from(sorted(self.live)))]

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.pick(data)
        child = FakeSeq(self.next_id, list(parent.token_ids))
        self.next_id += 1
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live[child.seq_id] = child

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        """The sequence finishes (or is aborted) and frees its blocks."""
        self.kv.free(self.live.pop(self.pick(data).seq_id))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), n=st.integers(1, 6))
    def decode(self, data: st.DataObject, n: int) -> None:
        """Up to `n` one-token steps of a live sequence; stops when no block is left for one."""
        seq = self.pick(data)
        for _ in range(n):
            seq.token_ids.append(7)
            seq.block_hashes = FakeSeq(0, seq.token_ids, extra=seq.extra).block_hashes
            if not self.kv.allocate(seq, 1):
                seq.token_ids.pop()
                seq.block_hashes = FakeSeq(0, seq.token_ids, extra=seq.extra).block_hashes
                self.decode_stopped()
                return
            self.decoded(seq)

    def decoded(self, seq: FakeSeq) -> None:
        """The step after `seq`'s new token got its slot: compute the token."""
        raise NotImplementedError

    def decode_stopped(self) -> None:
        """A decode step found no block for the new token."""
