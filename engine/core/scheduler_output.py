"""The scheduler's decision for one step (vLLM V1's core/sched/output.py): which sequences
compute how many tokens from where, and the block copies to carry out first."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.core.sequence import Sequence
from engine.kv.plan import KVPlan


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    """Tokens computed for this sequence in this step (1 for a decode)."""
    start: int
    """Position of the first of them (tokens before it are already in the cache)."""
    num_drafts: int = 0
    """Tokens proposed after the sequence's last one (speculative decoding, engine/core/spec/): the
    step computes them too (they count in num_new_tokens) and verifies them."""
    drafts: Seq[int] = ()
    """Those tokens, when the core proposed them (n-gram, suffix); empty when the worker's draft
    model proposes them during the step."""

    @property
    def samples(self) -> bool:
        """This chunk reaches the sequence's last token: the step samples its next token."""
        seq = self.seq
        end = self.start + self.num_new_tokens - self.num_drafts
        return end == len(seq.token_ids) + seq.num_pending


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    plan: KVPlan = field(default_factory=KVPlan)
    """Copies to carry out before the forward pass."""
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)
    """Sequences that can never be served, with the reason."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
