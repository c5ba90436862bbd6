"""Speculative decoding's proposals, made by the scheduler for each decoding sample.

A decoding sample normally computes one token a step. With a proposal of k tokens it computes
1 + k: its last token and the k proposed after it, in the same forward pass as the rest of the
batch; the sampler then samples all 1 + k positions and the sample keeps the proposed tokens up
to the first that differs from what was sampled at its position, plus the token sampled there
(engine/core/step_update.py, engine/worker/model_runner.py). Greedy output is therefore the same
token for token; sampled output keeps the target's distribution (engine/sample/sampler.py says
why). The KV written for rejected positions lies past the sample's computed tokens: the next step
overwrites it, and it is never hashed into the prefix cache.

Who gets a proposal (`Proposer.propose`):
- a running sample past its first token, with nothing in flight, not in beam search, without
  penalties (their sampling reads the output so far) and past min_tokens; under a grammar
  (structured outputs) only the proposal's prefix the grammar accepts (the token mask then has a
  row for each proposed position), and never from the draft model;
- only while at most `disable_by_batch_size` samples run: above that the step is no longer bound
  by weight reads, and extra positions cost time;
- adaptively (`DraftState`): a proposal that was fully accepted lets the next one grow by one, a
  partly accepted one sets the next to what was accepted plus one, and a fully rejected one halves
  it; after two fully rejected proposals in a row the sample waits 1, 2, 4, ... up to
  `MAX_BACKOFF` steps before it proposes again.

Methods: "ngram" looks the sample's last tokens up in its own prompt and output
(engine/core/spec/ngram.py); "suffix" also looks in its tenant's earlier outputs
(engine/core/spec/suffix.py) and proposes at most `suffix_decoding_max_spec_factor` tokens per
matched token; "draft_model" leaves the tokens to the worker's draft model, which proposes the
number the scheduler allots (engine/worker/draft_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.config import SpeculativeConfig
from engine.core.spec.ngram import TokenIndex
from engine.core.spec.state import DraftState
from engine.core.spec.suffix import SuffixCache
from engine.stats import SpecStats

if TYPE_CHECKING:
    from engine.core.sequence import Request, Sequence

MAX_BACKOFF = 16
"""Most steps a sample whose proposals keep failing waits before it proposes again."""


@dataclass(eq=False)
class Proposer:
    config: SpeculativeConfig
    stats: SpecStats = field(init=False)
    suffix: SuffixCache | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        c = self.config
        self.stats = SpecStats(accepted_per_pos=[0] * c.num_speculative_tokens)
        if c.method == "suffix":
            self.suffix = SuffixCache(
                c.prompt_lookup_min, c.prompt_lookup_max, c.suffix_decoding_max_cached_requests
            )

    def active(self, num_running: int) -> bool:
        """Whether samples get proposals in a step with `num_running` running samples."""
        return num_running <= self.config.disable_by_batch_size

    @staticmethod
    def eligible(req: Request) -> bool:
        """Whether the request's samples may ever get proposals (see the module docstring)."""
        p = req.params
        return not (
            p.use_beam_search
            or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
        )

    @property
    def on_worker(self) -> bool:
        """The worker's draft model makes the proposals (`draft_length` sizes them)."""
        return self.config.method == "draft_model"

    def _length(self, seq: Sequence, max_tokens: int) -> tuple[DraftState, int]:
        """The sample's state and how many tokens it may be proposed now (0: none)."""
        state = seq.draft
        if state is None:
            c = self.config
            state = seq.draft = DraftState(
                TokenIndex(c.prompt_lookup_min), c.num_speculative_tokens
            )
        if state.wait:
            state.wait -= 1
            return state, 0
        if seq.num_output_tokens < seq.request.params.min_tokens:
            return state, 0
        return state, max(0, min(state.limit, max_tokens))

    def draft_length(self, seq: Sequence, max_tokens: int) -> int:
        """draft_model: how many tokens the draft model proposes for the sample this step (none
        under a grammar: the draft model's tokens are known only on the worker, after the step's
        token mask was planned)."""
        if seq.request.params.response_format is not None:
            return 0
        return self._length(seq, max_tokens)[1]

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens to verify after the sample's last one (may be none)."""
        state, k = self._length(seq, max_tokens)
        if k <= 0:
            return []
        c = self.config
        tokens = seq.token_ids
        match = state.index.lookup(tokens, c.prompt_lookup_max, k)
        if self.suffix is not None:
            shared = self.suffix.lookup(seq.request.hash_extra, tokens, k)
            if shared is not None and (match is None or shared.length > match.length):
                match = shared
            if match is not None:
                cap = max(1, int(c.suffix_decoding_max_spec_factor * match.length))
                match.continuation = match.continuation[:cap]
        if match is None:
            return []
        if seq.grammar is not None:
            return _grammar_prefix(seq.grammar, match.continuation)
        return match.continuation

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verified proposal's outcome: stats, the request's counts, the next proposal's size."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.accepted_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1
        metrics = seq.request.metrics
        metrics.num_spec_steps += 1
        metrics.num_draft_tokens += num_drafts
        metrics.num_accepted_tokens += num_accepted
        state = seq.draft
        if state is None:
            return
        k = self.config.num_speculative_tokens
        if num_accepted == num_drafts:
            state.limit = min(k, max(state.limit, num_drafts) + 1)
            state.misses = 0
        elif num_accepted:
            state.limit = num_accepted + 1
            state.misses = 0
        else:
            state.limit = max(1, state.limit // 2)
            state.misses += 1
            if state.misses >= 2:
                state.wait = min(MAX_BACKOFF, 1 << (state.misses - 2))

    def finished(self, req: Request) -> None:
        """A finished request's samples join its tenant's corpus (suffix decoding)."""
        if self.suffix is None or req.error is not None:
            return
        for seq in req.seqs:
            if seq.finish_reason in ("stop", "length"):
                self.suffix.add(req.hash_extra, seq.token_ids, seq.num_prompt_tokens)


def _grammar_prefix(matcher: Any, tokens: list[int]) -> list[int]:
    """The longest prefix of `tokens` the sample's grammar accepts without ending (the matcher is
    left as it was): each verification row's mask then follows an accepted token."""
    n = 0
    for t in tokens:
        if not matcher.accept_token(t):
            break
        n += 1
        if matcher.is_terminated():  # the grammar's end: no mask row after it, nothing proposed
            matcher.rollback(1)
            n -= 1
            break
    if n:
        matcher.rollback(n)
    return tokens[:n]
