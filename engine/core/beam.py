"""Beam search bookkeeping: which candidates run on, which finish, when the search ends.

The rules are transformers' `generate(num_beams=W, do_sample=False)` (transformers 5,
`GenerationMixin._beam_search`), step for step:

1. The worker hands the K best continuations of the group's running beams by cumulative logprob
   (K = max(2, 1 + number of finishing tokens) * W; best first; engine/sample/beam.py).
2. A candidate *hits* when its token finishes (EOS unless ignore_eos, or a stop token id) or when
   it reaches the length limit (max_tokens, or max_model_len).
3. The next running beams are the W best candidates that do not hit, in order.
4. A candidate that hits and ranks among the first W of the K joins the finished hypotheses with
   score cumulative_logprob / generated_tokens ** length_penalty (generated tokens include the
   new one), unless the finished list is full and early_stopping is True, or an earlier step found
   that no running beam can improve it. The W best hypotheses are kept.
5. Once W hypotheses exist, the search can no longer improve when the best running beam's score,
   divided by L ** length_penalty, is not above the worst hypothesis: L is the current generated
   length, or max_tokens with early_stopping="never" and a positive length_penalty.
6. The search ends when it can no longer improve, when W hypotheses exist and early_stopping is
   True, or when every candidate hits. The n best hypotheses are the outputs.

Scores are float32, divided as transformers divides them (a float32 by a float32 denominator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np


@dataclass(slots=True)
class Hypothesis:
    """A finished beam."""

    token_ids: list[int]
    """Its generated tokens (the finishing token included)."""
    score: float
    """cumulative_logprob / len(token_ids) ** length_penalty, as a float32."""
    cumulative_logprob: float
    finish_reason: str
    """stop (a finishing token) or length."""
    stop_reason: int | None
    """The stop token id that ended it, when it is not an EOS."""


class Beam(Protocol):
    """A running beam, as the search reads it (engine/core/sequence.py's Sequence)."""

    @property
    def output_token_ids(self) -> list[int]: ...


B = TypeVar("B", bound=Beam)


@dataclass(slots=True)
class Candidate(Generic[B]):
    """One continuation of a running beam, as the worker ranked it."""

    parent: B
    token_id: int
    cumulative_logprob: float
    """The parent's cumulative logprob plus this token's (float32)."""


@dataclass(slots=True)
class BeamGroup:
    """One beam-search request's search state (its running beams are `Request.seqs`)."""

    width: int
    eos_token_ids: frozenset[int]
    """EOS ids that finish a beam (empty with ignore_eos)."""
    stop_token_ids: frozenset[int]
    length_penalty: float
    early_stopping: bool | str
    max_generated: int
    """Length limit of a beam's output: max_tokens, or what max_model_len leaves."""
    finished: list[Hypothesis] = field(default_factory=list)
    """At most `width` hypotheses, best first."""
    can_improve: bool = True
    """transformers' is_early_stop_heuristic_unsatisfied."""
    done: bool = False
    next_index: int = 1
    """Index of the next forked beam sequence (sequence 0 is the prompt's)."""

    @property
    def finishing(self) -> frozenset[int]:
        return self.eos_token_ids | self.stop_token_ids

    @property
    def num_candidates(self) -> int:
        """K: candidates ranked per step, enough that W of them never finish."""
        return max(2, 1 + len(self.finishing)) * self.width

    def _score(self, cumulative_logprob: float, length: int) -> float:
        denom = np.float32(float(length) ** self.length_penalty)
        return float(np.float32(cumulative_logprob) / denom)

    def select(self, candidates: list[Candidate[B]], num_generated: int) -> list[Candidate[B]]:
        """One step: `candidates` are the K best continuations, best first, of running beams
        that have generated `num_generated` tokens. Returns the next running beams (best first);
        sets `done` when the search ends."""
        new_len = num_generated + 1
        finishing = self.finishing
        at_limit = new_len >= self.max_generated
        hits = [at_limit or c.token_id in finishing for c in candidates]
        running = [c for c, hit in zip(candidates, hits, strict=True) if not hit][: self.width]
        full = len(self.finished) == self.width
        if self.can_improve and not (full and self.early_stopping is True):
            new = [
                self._hypothesis(c, new_len)
                for c, hit in zip(candidates[: self.width], hits, strict=False)
                if hit
            ]
            if new:
                merged = self.finished + new
                merged.sort(key=lambda h: h.score, reverse=True)  # stable: older first on ties
                self.finished = merged[: self.width]
        full = len(self.finished) == self.width
        if self.can_improve and full and running:
            never = self.early_stopping == "never" and self.length_penalty > 0.0
            best_len = self.max_generated if never else new_len
            best_possible = self._score(running[0].cumulative_logprob, best_len)
            self.can_improve = best_possible > self.finished[-1].score
        self.done = not self.can_improve or (full and self.early_stopping is True) or all(hits)
        return [] if self.done else running

    def _hypothesis(self, c: Candidate, length: int) -> Hypothesis:
        tokens = [*c.parent.output_token_ids, c.token_id]
        stop = c.token_id in self.finishing
        return Hypothesis(
            token_ids=tokens,
            score=self._score(c.cumulative_logprob, length),
            cumulative_logprob=c.cumulative_logprob,
            finish_reason="stop" if stop else "length",
            stop_reason=c.token_id if stop and c.token_id not in self.eos_token_ids else None,
        )
