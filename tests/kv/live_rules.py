"""Rules both allocator state machines share: forking and freeing a live sequence."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from engine.kv.manager import KVCacheManager
from tests.kv.test_manager import FakeSeq


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
