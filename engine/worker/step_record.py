"""What the engine core hands the workers each step (vLLM V1's SchedulerOutput): plain data.

The worker never reads the scheduler's objects. It learns a sequence once, when the sequence is
first scheduled (`NewSequence`: its tokens so far, its request's sampling parameters), keeps its
own state for it across steps (engine/worker/seq_state.py), appends the tokens it samples itself,
and forgets it when the core says so. The core sends tokens only where the worker did not sample
them: a new sequence's (a prompt, a forked sample, a forked beam) and the tokens beam search
chose for its running beams.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.kv.plan import KVPlan
from engine.sample.sampling_params import SamplingParams


class PendingTokenMask(Protocol):
    """The step's structured-output token mask, being filled off the step (engine/sample/
    structured/mask_filler.py's PendingMask): one row per sampling row, in row order."""

    def result(self) -> Any:
        """The mask the sampler applies (waits for the fill, re-raising its error)."""
        ...

    def wait(self) -> None:
        """Lets a fill in flight finish (before an error leaves the step)."""
        ...


@dataclass(slots=True)
class NewSequence:
    """A sequence the worker has not seen: its first scheduling, a forked sample or beam."""

    seq_id: int
    request_id: str
    index: int
    """Its sample index within the request (a seeded request's generator is seed + index)."""
    token_ids: list[int]
    """Prompt and output tokens so far (the worker's own copy)."""
    num_prompt_tokens: int
    params: SamplingParams


@dataclass(slots=True)
class BeamRanking:
    """A beam-search request ranking its running beams' continuations this step."""

    seq_ids: list[int]
    """The running beams, in the order the core reads the candidates back."""
    scores: list[float]
    """Each beam's cumulative logprob."""
    num_candidates: int
    banned: list[int]
    """Tokens no candidate may take (finishing tokens while the beams are under min_tokens)."""


@dataclass(slots=True)
class StepRecord:
    """One step's work, in the scheduler's order: every scheduled sequence computes
    `num_new_tokens[i]` tokens from position `starts[i]` with block table `block_tables[i]`."""

    plan: KVPlan
    """Block copies (CPU and disk tiers, copy-on-write) to carry out before the forward."""
    seq_ids: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    """NOTE: the KV manager hands out the same list for a table until the table changes; the
    input batch rewrites a row only when its list is another one."""
    samples: list[int] = field(default_factory=list)
    """Index (into the lists above) of each sequence that samples its next token this step."""
    fan_out: dict[int, int] = field(default_factory=dict)
    """Sequences that sample n > 1 rows (a request's first token, before its n samples fork):
    index -> n. Every other sampling sequence samples one row."""
    drafts: dict[int, list[int]] = field(default_factory=dict)
    """Sequences verifying proposed tokens (speculative decoding): index -> the tokens proposed
    after its last one. Such a sequence computes 1 + len(tokens) positions and samples a row at
    each (engine/worker/model_runner.py)."""
    propose: dict[int, int] = field(default_factory=dict)
    """Sequences whose proposal the worker's draft model makes in the step: index -> how many
    tokens (engine/worker/draft_runner.py); they verify them like `drafts`."""
    beams: list[BeamRanking] = field(default_factory=list)
    new_seqs: list[NewSequence] = field(default_factory=list)
    """Sequences to learn before the step (they may also be scheduled in it)."""
    appended: list[tuple[int, int]] = field(default_factory=list)
    """(seq_id, token) the core appended without the worker sampling it (beam search)."""
    finished: list[int] = field(default_factory=list)
    """Sequences to forget (their requests have ended)."""
    token_mask: PendingTokenMask | None = None
    """The sampling rows' structured-output mask; None when no row has a grammar."""

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(self.num_new_tokens)
