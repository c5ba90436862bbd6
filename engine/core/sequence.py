"""Request and sequence state.

A request holds one prompt and n samples. It starts as one sequence (sample 0) that prefills the
prompt; when the prompt's last token is computed, n tokens are sampled from its logits and the
request forks into n sequences that share the prompt's blocks (the partly filled tail block is
copied on write). From then on every sequence is scheduled on its own.

Beam search (`params.use_beam_search`): the prompt's sequence ranks continuations instead of
sampling; its `BeamGroup` (engine/core/beam.py) keeps the running beams in `seqs`, forks a beam
that two candidates continue (blocks shared, tail copied on write) and drops a beam that none
continues. The scheduler runs a group's beams in lockstep (engine/core/scheduler.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.core.beam import BeamGroup
from engine.kv.hashing import BlockHash, hash_block
from engine.outputs import CachedTokens, RequestMetrics
from engine.sample.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr

    from engine.core.spec.state import DraftState
    from engine.kv.manager import KVCacheManager
    from engine.sample.structured.compiler import Grammar


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    hash_extra: bytes
    """Extra keys of this request's block hashes (model identity, cache salt)."""
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    cached_tokens: CachedTokens = field(default_factory=CachedTokens)
    error: str | None = None
    pinned: bool | None = None
    waiting_for_grammar: bool = False
    """Its response_format is still compiling: the scheduler skips it (others go ahead)."""
    waiting_for_remote: bool = False
    """Its remote-tier lookup is running: the scheduler skips it (others go ahead)."""
    compiled_grammar: Grammar | None = None
    """Set by the engine when the grammar is ready (engine side only; never pickled)."""
    beam: BeamGroup | None = None
    """Beam search's state (engine side); `seqs` then holds the running beams, best first."""
    worker_seq_ids: list[int] = field(default_factory=list)
    """Its sequences the workers were told of (they forget them when the request ends)."""
    speculates: bool = False
    """Its samples may get speculative proposals (engine/core/spec/proposer.py's `eligible`)."""
    ranks_samples: bool = field(init=False, default=False)
    """params.ranks_samples (best_of > n), read once: the core asks every step."""

    def __post_init__(self) -> None:
        self.ranks_samples = self.params.ranks_samples

    @property
    def num_cached_tokens(self) -> int:
        return self.cached_tokens.total

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        if len(self.seqs) == 1 or (not self.forked and self.params.num_samples > 1):
            return bool(self.seqs) and self.seqs[0].status is SeqStatus.FINISHED
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    request: Request
    index: int
    """Sample index within the request (0..n-1)."""
    token_ids: list[int]
    """Prompt + generated tokens."""
    block_size: int
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Hashes of the full blocks of token_ids, extended as blocks fill."""
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache (cached prefix, prefill chunks, decode steps)."""
    num_cached_blocks: int = 0
    """Leading blocks already registered in the prefix cache."""
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    cum_logprob: float = 0.0
    """Sum of the logprobs of its generated tokens (beam search, best_of)."""
    on_worker: bool = False
    """The workers know this sequence (engine/worker/step_record.py's NewSequence was sent)."""
    num_pending: int = 0
    """Tokens sampled by steps still in flight (async scheduling, engine/core/engine_core.py):
    their positions count as computed, their ids are not yet in `token_ids`."""
    max_len: int = 1 << 62
    """The length at which the sample ends by length (max_tokens or max_model_len; set with its
    stop rules): async scheduling never schedules a token past it."""
    grammar: xgr.GrammarMatcher | None = None
    """This sample's grammar matcher (structured outputs); it has accepted every output token.
    It outlives preemption: recompute and swap keep the tokens, so the state stays valid."""

    draft: DraftState | None = None
    """Its speculative proposals' state (engine/core/spec/proposer.py); None until it first proposes."""

    num_prompt_tokens: int = field(init=False, default=0)
    """len(request.prompt_token_ids): the first tokens of token_ids are the prompt's."""

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.request.prompt_token_ids)
        self.update_hashes()

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    def update_hashes(self) -> None:
        """Hashes blocks that became full; each block is hashed once in the sequence's life."""
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            tokens = self.token_ids[i * bs : (i + 1) * bs]
            self.block_hashes.append(hash_block(parent, tokens, self.request.hash_extra))

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            self.update_hashes()

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


class SequenceQueues(Protocol):
    """What a step's update does to the scheduler's queues (engine/core/scheduler.py's
    `Scheduler`; named here so the update and beam search need not import it)."""

    kv: KVCacheManager

    def add_running(self, seq: Sequence) -> None: ...

    def remove(self, seq: Sequence) -> None: ...

    def regroup(self, old: list[Sequence], new: list[Sequence]) -> None: ...

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None: ...
