"""What a step's results do to the engine's state (vLLM's `Scheduler.update_from_output`).

Once the runner has launched a step, `EngineCore.step` counts its scheduled tokens as computed
(`_advance`: newly full blocks join the prefix cache); when its results are on the host (at once,
or one step later under async scheduling) they come here as a `StepOutput`: each sampled token is
appended to its sequence and checked against the stop rules (a sample that ends frees its blocks),
a request's first token forks its n samples, and beam groups advance. This runs over every
scheduled sequence each step, so its common case (a running sample's next token) is written
inline.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from engine.core.beam_step import advance_beams
from engine.core.output_processor import OutputProcessor
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Request, SeqStatus, Sequence
from engine.core.step_rates import StepRates
from engine.core.step_records import RecordedStep, StepRecords
from engine.kv.manager import KVCacheManager
from engine.kv.tiers import TieredCache
from engine.outputs import TokenLogprob
from engine.sample.beam import BeamCandidate
from engine.worker.model_runner import StepHandle, StepOutput


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step the runner launched and the core has advanced, until its results are processed."""

    handle: StepHandle
    step: RecordedStep
    """Its record, and who owns its rows."""
    scheduled_at: float
    counts: tuple[int, int]
    """(prefill tokens, decode sequences): the step rates' sample, taken when it completes."""


class StepUpdate:
    """The engine core's update from a step's output (a mixin of `EngineCore`, whose state it
    reads and changes)."""

    kv: KVCacheManager
    scheduler: Scheduler
    outputs: OutputProcessor
    tiers: TieredCache | None
    step_rates: StepRates
    records: StepRecords
    _touched: dict[str, Request]
    """Requests with news since the last step's outputs were built."""
    _seq_ids: Iterator[int]
    _last_done = 0.0
    """When the last step with scheduled tokens completed (monotonic seconds)."""

    def _new_seq(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        raise NotImplementedError  # EngineCore's

    def update_from_output(
        self, launched: LaunchedStep, out: StepOutput, now: float, *, deferred: bool
    ) -> None:
        """The step `launched` (advanced at launch) sampled `out`: every part of the engine's
        state follows. `deferred`: the step was left in flight (its tokens were pending; the
        caller has released them)."""
        prefill, decodes = launched.counts
        if prefill or decodes:
            start = launched.scheduled_at
            if deferred:  # it overlapped the step before: its time starts where that one ended
                start = max(start, self._last_done)
            self.step_rates.observe(prefill, decodes, now - start, now)
            self._last_done = now
        for (req, beams), ranked in zip(launched.step.beam_groups, out.beams, strict=True):
            self._process_beams(req, beams, ranked, now)
        self._process_samples(launched.step, out, now, deferred)

    def _advance(self, sched: SchedulerOutput) -> tuple[int, int]:
        """The scheduled tokens count as computed once the step is launched (its KV writes come
        before any later step's reads on the device): counts, newly full blocks cached (blocks
        whose tokens are all known; the scheduler stamps a request's first scheduling when it
        admits it). Returns (prefill tokens, decode sequences)."""
        decodes = prefill = 0
        kv = self.kv
        caching = kv.enable_caching
        bs = kv.block_size
        for item in sched.scheduled:
            seq = item.seq
            if item.start >= seq.num_prompt_tokens:
                decodes += 1
            else:
                prefill += item.num_new_tokens
            seq.num_computed_tokens += item.num_new_tokens
            # cache_blocks' own first test, inline: most steps fill no block
            if caching and seq.num_computed_tokens >= bs * (seq.num_cached_blocks + 1):
                kv.cache_blocks(seq)
        return prefill, decodes

    def _process_samples(
        self, step: RecordedStep, out: StepOutput, now: float, deferred: bool = False
    ) -> None:
        """Appends each sampled token to its sequence and checks whether the sample ends.

        `deferred`: the tokens were pending (async scheduling): a token that completes a block
        caches it (the step after computed its KV). A sample that ended (a stop, an abort) since
        the step was launched drops its token: under async scheduling a step may complete after
        the one before it ended the sample."""
        touched = self._touched
        token_ids, logprobs = out.token_ids, out.logprobs
        process_token = self.outputs.process_token
        kv = self.kv
        bs = kv.block_size
        k = 0
        for item, n in step.owners:
            seq = item.seq
            if seq.status is SeqStatus.FINISHED:
                k += n
                continue
            req = seq.request
            touched[req.request_id] = req
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
                self._finish(seq, end.reason, end.stop_reason)

    def _first_tokens(
        self,
        seq: Sequence,
        token_ids: list[int],
        logprobs: list[TokenLogprob | None],
        now: float,
        deferred: bool = False,
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
            child = self._new_seq(req, i, list(req.prompt_token_ids))
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
        self._touched[req.request_id] = req
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        self._pin_prompt(beams[0], now)
        advance_beams(req, beams, ranked, self.scheduler, self._seq_ids)
        for seq in req.seqs:  # the tokens the search chose, for the workers' own copies
            self.records.appended(seq)

    def _append(
        self, seq: Sequence, token_id: int, logprob: TokenLogprob | None, deferred: bool = False
    ) -> None:
        seq.append_token(token_id)
        if deferred:  # the token may complete a block whose KV the next step computed
            self.kv.cache_blocks(seq)
        if logprob is not None:
            seq.cum_logprob += logprob.logprob
        end = self.outputs.process_token(seq, token_id, logprob)
        if end is not None:
            self._finish(seq, end.reason, end.stop_reason)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        self.scheduler.remove(seq)
        seq.finish(reason, stop_reason)
