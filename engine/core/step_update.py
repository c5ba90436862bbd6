"""What a step's output does to requests and sequences (vLLM's `Scheduler.update_from_output`),
held by the scheduler (`Scheduler.update_from_output`).

When a step's results are on the host (at once, or one step later under async scheduling) they
come here with the step's record: each sampled token is appended to its sequence and checked
against the stop rules (a sample that ends frees its blocks), a request's first token forks its n
samples, and beam groups advance. This runs over every scheduled sequence each step, so its
common case (a running sample's next token) is written inline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.beam_step import advance_beams
from engine.core.output_processor import OutputProcessor
from engine.core.sequence import Request, SeqStatus, Sequence, SequenceQueues
from engine.core.step_records import RecordedStep
from engine.kv.manager import KVCacheManager
from engine.kv.tiers import TieredCache
from engine.outputs import TokenLogprob
from engine.sample.beam import BeamCandidate
from engine.worker.model_runner import StepOutput, num_accepted

if TYPE_CHECKING:
    from engine.core.spec.proposer import Proposer


@dataclass(frozen=True, slots=True, eq=False)
class StepUpdate:
    """The scheduler's update from a step's output."""

    scheduler: SequenceQueues
    kv: KVCacheManager
    outputs: OutputProcessor
    tiers: TieredCache | None
    """Prompt pins reach the CPU tier too (best effort within its cap)."""
    proposer: Proposer | None = None
    """Speculative decoding's: learns how each proposal fared."""

    def apply(self, step: RecordedStep, out: StepOutput, now: float, deferred: bool) -> None:
        """The step `step` (advanced at launch) sampled `out`: every sequence follows.
        `deferred`: the step was left in flight (its tokens were pending; the caller has
        released them)."""
        for (req, beams), ranked in zip(step.beam_groups, out.beams, strict=True):
            self._process_beams(req, beams, ranked, now)
        self._process_samples(step, out, now, deferred)

    def _process_samples(
        self, step: RecordedStep, out: StepOutput, now: float, deferred: bool
    ) -> None:
        """Appends each sampled token to its sequence and checks whether the sample ends.

        `deferred`: the tokens were pending (async scheduling): a token that completes a block
        caches it (the step after computed its KV). A sample that ended (a stop, an abort) since
        the step was launched drops its token: under async scheduling a step may complete after
        the one before it ended the sample."""
        touched = self.outputs.touched
        token_ids, logprobs = out.token_ids, out.logprobs
        process_token = self.outputs.process_token
        kv = self.kv
        bs = kv.block_size
        k = 0
        proposals = iter(out.drafts)
        for item, n in step.owners:
            seq = item.seq
            drafts = next(proposals) if item.num_drafts else None
            if seq.status is SeqStatus.FINISHED:
                k += n
                continue
            req = seq.request
            touched[req.request_id] = req
            if drafts is not None:
                self._verified(seq, drafts, token_ids[k : k + n], logprobs[k : k + n])
                k += n
                continue
            if not req.forked:
                self._first_tokens(seq, token_ids[k : k + n], logprobs[k : k + n], now, deferred)
                k += n
                continue
            # A running sample's next token, the common case: `_append`, inline.
            token_id, logprob = token_ids[k], logprobs[k]
            k += 1
            seq.append_token(token_id)
            if deferred and seq.num_computed_tokens >= bs * (seq.num_cached_blocks + 1):
                kv.cache_blocks(seq)
            if logprob is not None:
                seq.cum_logprob += logprob.logprob
            end = process_token(seq, token_id, logprob)
            if end is not None:
                self.scheduler.finish(seq, end.reason, end.stop_reason)

    def _verified(
        self,
        seq: Sequence,
        drafts: list[int],
        token_ids: list[int],
        logprobs: list[TokenLogprob | None],
    ) -> None:
        """A sample verified a proposal: it keeps the proposed tokens its rows sampled too, up
        to the first that differs, and that row's token (engine/worker/model_runner.py's
        `Verifier`). The positions past them are no longer computed: their KV is overwritten
        by later steps, and their blocks are hashed only once their real tokens are known."""
        a = num_accepted(drafts, token_ids, 0)
        seq.num_computed_tokens -= len(drafts) - a
        assert self.proposer is not None
        self.proposer.observe(seq, len(drafts), a)
        for j in range(a + 1):  # a stop among them ends the sample there
            self._append(seq, token_ids[j], logprobs[j], deferred=False)
            if seq.status is SeqStatus.FINISHED:
                return

    def _first_tokens(
        self,
        seq: Sequence,
        token_ids: list[int],
        logprobs: list[TokenLogprob | None],
        now: float,
        deferred: bool,
    ) -> None:
        """A request's first token, or one per sample for n > 1 (they fork the prompt here)."""
        req = seq.request
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        if req.params.pin_ttl_s > 0:
            self._pin_prompt(seq, now)
        req.forked = True
        children = [seq]
        for i in range(1, len(token_ids)):
            child = self.outputs.new_sample(req, i, list(req.prompt_token_ids))
            child.num_computed_tokens = seq.num_computed_tokens
            self.kv.fork(seq, child)
            self.scheduler.add_running(child)
            children.append(child)
        for child, tok, lp in zip(children, token_ids, logprobs, strict=True):
            self._append(child, tok, lp, deferred)

    def _pin_prompt(self, seq: Sequence, now: float) -> None:
        """pin_ttl_s: pins the prompt's blocks once, when its first token is out."""
        req = seq.request
        if req.params.pin_ttl_s > 0 and req.pinned is None:
            req.pinned = self.kv.pin(seq, len(req.prompt_token_ids), now + req.params.pin_ttl_s)
            if req.pinned and self.tiers is not None:  # best effort within the CPU tier's cap
                n_full = len(req.prompt_token_ids) // self.kv.block_size
                self.tiers.pin(seq.block_hashes[:n_full], now + req.params.pin_ttl_s)

    def _process_beams(
        self, req: Request, beams: list[Sequence], ranked: list[BeamCandidate], now: float
    ) -> None:
        self.outputs.touch(req)
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        self._pin_prompt(beams[0], now)
        advance_beams(req, beams, ranked, self.scheduler, self.outputs.seq_ids)

    def _append(
        self, seq: Sequence, token_id: int, logprob: TokenLogprob | None, deferred: bool
    ) -> None:
        seq.append_token(token_id)
        if deferred:  # the token may complete a block whose KV the next step computed
            self.kv.cache_blocks(seq)
        if logprob is not None:
            seq.cum_logprob += logprob.logprob
        end = self.outputs.process_token(seq, token_id, logprob)
        if end is not None:
            self.scheduler.finish(seq, end.reason, end.stop_reason)
