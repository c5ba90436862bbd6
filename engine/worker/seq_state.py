"""The worker's own state of every sequence it has been told of (vLLM V1's CachedRequestState).

A sequence is learnt from a `NewSequence` (engine/worker/step_record.py) and kept until the core
says it is finished: its tokens (the worker appends those it samples, and the core's beam-search
choices), its request's sampling parameters and seeded generators (shared by the request's
samples, so a forked sample's generator goes on where the first token's draw left it), and its
sampling row, made the first time it samples alone and reused every step after.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sample.sampler import OutputTokens, SamplingRow
from engine.sample.sampling_params import SamplingParams
from engine.worker.step_record import NewSequence, StepRecord


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generators: list[torch.Generator | None]
    """One per sample index; None without a seed of its own."""
    live: int = 0
    """Sequences of the request the worker still holds."""


@dataclass(slots=True, eq=False)
class SeqState:
    token_ids: list[int]
    """Prompt and output tokens (a token in flight is not here yet)."""
    num_prompt_tokens: int
    request: RequestState
    index: int
    row: SamplingRow | None = None
    """Its own sampling row once it samples one row a step (a live view of its output)."""
    pending_row: int = 0
    """Its row in the sampled ids of the step in flight (async scheduling): while that step's
    token is not in `token_ids`, the next step's input id is gathered from it on the device."""
    draft_len: int | None = None
    """Positions whose KV the draft model's cache holds for this sequence's tokens (speculative
    decoding's draft model); None: as many as the target's (a prefix-cache hit included)."""

    def sampling_row(self) -> SamplingRow:
        row = self.row
        if row is None:
            req = self.request
            output = OutputTokens(self.token_ids, self.num_prompt_tokens)
            row = self.row = SamplingRow(
                req.params, req.prompt_token_ids, output, req.generators[self.index]
            )
        return row

    def first_rows(self, n: int) -> list[SamplingRow]:
        """The rows of a request's first token sampled n times (its samples fork after it)."""
        req = self.request
        return [
            SamplingRow(req.params, req.prompt_token_ids, [], req.generators[i]) for i in range(n)
        ]


@dataclass(eq=False)
class SeqStates:
    """Every sequence the worker holds, by seq_id, and their requests."""

    device: torch.device
    seqs: dict[int, SeqState] = field(default_factory=dict)
    requests: dict[str, RequestState] = field(default_factory=dict)
    _last_ids: list[int] = field(default_factory=list)
    _last_states: list[SeqState] = field(default_factory=list)

    def update(self, record: StepRecord) -> list[SeqState]:
        """Takes in the record's news (the core's tokens, finished and new sequences); returns
        the scheduled sequences' states in record order."""
        seqs = self.seqs
        for seq_id, token in record.appended:  # before `finished`: the search may have ended
            seqs[seq_id].token_ids.append(token)
        for seq_id in record.finished:
            self._forget(seq_id)
        for new in record.new_seqs:
            self._learn(new)
        ids = record.seq_ids
        if ids != self._last_ids:  # a steady decode schedules the same sequences every step
            self._last_ids, self._last_states = ids, [seqs[i] for i in ids]
        return self._last_states

    def _learn(self, new: NewSequence) -> None:
        req = self.requests.get(new.request_id)
        if req is None:
            params = new.params
            n, seed = params.num_samples, params.seed
            gens: list[torch.Generator | None] = [None] * n
            if seed is not None:
                gens = [torch.Generator(device=self.device).manual_seed(seed + i) for i in range(n)]
            prompt = new.token_ids[: new.num_prompt_tokens]
            req = RequestState(new.request_id, prompt, params, gens)
            self.requests[new.request_id] = req
        req.live += 1
        # the record's list is the worker's from here on (the core sent a copy)
        state = SeqState(new.token_ids, new.num_prompt_tokens, req, new.index)
        self.seqs[new.seq_id] = state

    def _forget(self, seq_id: int) -> None:
        state = self.seqs.pop(seq_id, None)
        if state is None:
            return
        req = state.request
        req.live -= 1
        if not req.live:
            del self.requests[req.request_id]
