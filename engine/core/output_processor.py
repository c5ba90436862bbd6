"""From sampled tokens to what the core streams: stop checks and token deltas.

The anchor is vLLM v1's OutputProcessor split: `Sequence` keeps the scheduling state (tokens,
blocks, status), this keeps each sample's output state (its logprobs, the tokens already streamed).
`EngineCore` appends a sampled token to the sequence, asks `process_token` whether the sample ends
with it, and after each step turns the requests with news into `RequestOutput` deltas with
`make_outputs`: token ids, logprobs and finish reasons. Their text is made in the front end
(engine/frontend/output_text.py), off the core's step; only a request with stop strings is decoded
here too, since a stop string decides when its sample ends.

Stop rules, in order (the first that holds ends the sample):
    the grammar rejects the token                        error (only with conflicting settings)
    a stop token id, once min_tokens are out             stop, stop_reason = the token id
    an EOS token (unless ignore_eos), once min_tokens    stop
    the grammar has terminated                           stop
    a stop string completed in the text                  stop, stop_reason = the string
    max_tokens out, or the sequence reached max_model_len  length
The token that ends a sample by one of the first four rules is not part of its text.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.sequence import Request, SeqStatus, Sequence
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob

if TYPE_CHECKING:
    from engine.sample.structured.compiler import Grammar
    from engine.stats import ModelInfo


class StopDecision(NamedTuple):
    reason: str
    """stop, length or error."""
    stop_reason: int | str | None


@dataclass(slots=True)
class SampleOutput:
    """What one sample has produced for its stream."""

    detokenizer: IncrementalDetokenizer | None
    """Only for a request with stop strings: finds them (its text is not sent)."""
    logprobs: list[TokenLogprob] | None
    min_total: int
    """Length (prompt + output) from which a stop token may end it (min_tokens)."""
    max_total: int
    """Length at which it ends for length (max_tokens, max_model_len)."""
    stop_at_eos: bool
    """Not ignore_eos."""
    sent_tokens: int = 0
    sent_logprobs: int = 0
    final_sent: bool = False
    """The delta carrying finish_reason has been handed out."""


class OutputProcessor:
    """Every sample's output state: made with the sample (`new_sample`), fed each token
    (`process_token`), turned into the deltas of the requests with news (`make_outputs`)."""

    def __init__(
        self,
        tokenizer: Any,
        info: ModelInfo,
        new_matcher: Callable[[Grammar], Any],
    ) -> None:
        self.tokenizer = tokenizer
        self.info = info
        """The model's stop token ids, length limit and block size."""
        self._new_matcher = new_matcher
        """A fresh grammar matcher for a compiled response format (structured outputs)."""
        self.seq_ids = itertools.count()
        self._samples: dict[int, SampleOutput] = {}
        """seq_id -> its output state, from `add_sample` until its request's last delta."""
        self.touched: dict[str, Request] = {}
        """Requests with news since the last `make_outputs`."""

    def touch(self, req: Request) -> None:
        self.touched[req.request_id] = req

    def new_sample(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        """Sample `index` of `req` (its first, or one forked after the first token), with its
        grammar matcher and its output state."""
        seq = Sequence(next(self.seq_ids), req, index, token_ids, self.info.block_size)
        if req.compiled_grammar is not None:
            seq.grammar = self._new_matcher(req.compiled_grammar)
        if req.beam is None:
            self.add_sample(seq)
        req.seqs.append(seq)
        return seq

    def add_sample(self, seq: Sequence) -> None:
        req = seq.request
        params = req.params
        prompt = seq.num_prompt_tokens
        max_total = self.info.max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, prompt + params.max_tokens)
        seq.max_len = max_total
        self._samples[seq.seq_id] = SampleOutput(
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
            if params.stop
            else None,
            [] if req.params.logprobs is not None else None,
            min_total=prompt + params.min_tokens,
            max_total=max_total,
            stop_at_eos=not params.ignore_eos,
        )

    def process_token(self, seq: Sequence, token_id: int, logprob: object) -> StopDecision | None:
        """Records a token already appended to `seq`; returns how the sample ends, if it does."""
        out = self._samples[seq.seq_id]
        if out.logprobs is not None and logprob is not None:
            out.logprobs.append(logprob)  # type: ignore[arg-type]
        length = len(seq.token_ids)
        grammar = seq.grammar
        if grammar is not None and not grammar.accept_token(token_id):
            # Not expected: the mask allows only what the grammar accepts, and the sampler lifts
            # min_tokens' ban where it would leave a constrained row no token.
            seq.request.error = f"token {token_id} does not fit the response_format"
            return StopDecision("error", None)
        if length >= out.min_total:  # the outputs, this token included, reach min_tokens
            if token_id in seq.request.params.stop_token_ids:
                return StopDecision("stop", token_id)
            if out.stop_at_eos and token_id in self.info.eos_token_ids:
                return StopDecision("stop", None)
        if grammar is not None and grammar.is_terminated():
            return StopDecision("stop", None)  # the grammar ended (with ignore_eos set)
        detok = out.detokenizer
        if detok is not None:
            detok.add(token_id)
            if detok.stop_string is not None:
                return StopDecision("stop", detok.stop_string)
        if length >= out.max_total:
            return StopDecision("length", None)
        return None

    def make_outputs(self) -> list[RequestOutput]:
        """One delta per request with news: each sample's new tokens and logprobs since the last.

        Beam search and best_of > n rank whole outputs, so their requests send nothing until
        they finish; then one message carries the n best outputs in full, best first.
        """
        requests, self.touched = self.touched, {}
        outs: list[RequestOutput] = []
        append = outs.append
        samples = self._samples
        sample_of = samples.get
        done = SeqStatus.FINISHED
        for rid, req in requests.items():
            seqs = req.seqs
            if len(seqs) == 1 and req.beam is None and not req.ranks_samples:
                # One sample, the common case: `Request.finished` and the delta, inline.
                seq = seqs[0]
                finished = seq.status is done
                out = sample_of(seq.seq_id)
                start = seq.num_prompt_tokens + (0 if out is None else out.sent_tokens)
                tokens = seq.token_ids
                if (
                    not finished
                    and out is not None
                    and out.logprobs is None
                    and len(tokens) == start + 1
                ):  # a decode step's delta, `_delta` inline: one new token, nothing else
                    out.sent_tokens += 1
                    deltas = [CompletionOutput(seq.index, "", [tokens[start]])]
                else:
                    delta = self._delta(seq)
                    deltas = [] if delta is None else [delta]
                if finished:
                    samples.pop(seq.seq_id, None)
            else:
                finished = req.finished
                if req.beam is not None or req.ranks_samples:
                    if not finished:
                        continue
                    deltas = self._beam_outputs(req) if req.beam is not None else self._best_of(req)
                else:
                    deltas = [d for seq in seqs if (d := self._delta(seq)) is not None]
                if finished:
                    for seq in seqs:
                        samples.pop(seq.seq_id, None)
            cached = req.cached_tokens
            append(
                RequestOutput(
                    rid,
                    req.prompt_token_ids,
                    deltas,
                    finished,
                    cached.total,
                    cached,
                    req.metrics,
                    req.error,
                    req.pinned,
                )
            )
        return outs

    def _best_of(self, req: Request) -> list[CompletionOutput]:
        """The n samples with the highest cumulative logprob, renumbered 0..n-1 best first."""
        best = sorted(req.seqs, key=lambda s: s.cum_logprob, reverse=True)[: req.params.n]
        return [d for i, seq in enumerate(best) if (d := self._delta(seq, i)) is not None]

    def _beam_outputs(self, req: Request) -> list[CompletionOutput]:
        """The n best finished beams (an aborted or failed search: its running beams); their
        text is decoded in the front end."""
        group, params = req.beam, req.params
        assert group is not None
        if (
            group.finished
            and req.error is None
            and all(s.finish_reason != "abort" for s in req.seqs)
        ):
            return [
                CompletionOutput(
                    index=i,
                    token_ids=h.token_ids,
                    finish_reason=h.finish_reason,
                    stop_reason=h.stop_reason,
                    cumulative_logprob=h.cumulative_logprob,
                )
                for i, h in enumerate(group.finished[: params.n])
            ]
        reason = "error" if req.error is not None else "abort"
        return [
            CompletionOutput(
                index=i,
                token_ids=seq.output_token_ids,
                finish_reason=reason,
                cumulative_logprob=seq.cum_logprob,
            )
            for i, seq in enumerate(req.seqs[: params.n])
        ]

    def _delta(self, seq: Sequence, index: int | None = None) -> CompletionOutput | None:
        out = self._samples.get(seq.seq_id)
        if out is None or out.final_sent:
            return None
        reason = seq.finish_reason
        new_tokens = seq.token_ids[seq.num_prompt_tokens + out.sent_tokens :]
        if not new_tokens and reason is None:
            return None
        lps = None
        if out.logprobs is not None:
            lps = out.logprobs[out.sent_logprobs :]
            out.sent_logprobs = len(out.logprobs)
        ranked = reason is not None and seq.request.params.wants_logprob
        out.sent_tokens += len(new_tokens)
        out.final_sent = reason is not None
        return CompletionOutput(
            seq.index if index is None else index,
            "",  # the front end makes the text
            new_tokens,
            lps,
            reason,
            seq.stop_reason,
            seq.cum_logprob if ranked else None,
        )
