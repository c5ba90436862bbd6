"""Builds the flat batch of a step, carries out the KV plan, runs the model and the sampler."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Protocol

import torch

from engine.kv.plan import KVPlan
from engine.outputs import TokenLogprob
from engine.sample.beam import BeamCandidate, BeamRows, top_candidates
from engine.sample.sampler import SampledBatch, Sampler, SamplingRow, host_to_device
from engine.worker.attention.base import AttentionBackend
from engine.worker.cuda_graphs import DecodeGraphs, graph_sizes
from engine.worker.draft_runner import DraftRunner
from engine.worker.input_batch import InputBatch, StepInputs
from engine.worker.parallel.messages import StepBatch
from engine.worker.seq_state import SeqState, SeqStates
from engine.worker.step_record import StepRecord

Followers = Callable[[KVPlan, StepBatch | None, list[int]], None]
"""Sends one step (its plan, its flat batch, the rows rank 0 samples) to ranks 1..N-1."""


class Offload(Protocol):
    """Carries out the CPU/disk parts of a plan (engine/kv_io/offload.py)."""

    def apply(self, plan: KVPlan, kv_cache: torch.Tensor) -> None: ...


@dataclass(slots=True)
class StepOutput:
    """What one step sampled (vLLM's ModelRunnerOutput): flat lists in row order (the record's
    sampling sequences in order, n rows where it fans out), so the core walks them once."""

    token_ids: list[int] = field(default_factory=list)
    """One sampled token per row."""
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """Per row; None where neither logprobs nor best_of's ranking asks for them."""
    beams: list[list[BeamCandidate]] = field(default_factory=list)
    """Each of the record's beam rankings' K best continuations, best first."""
    drafts: list[list[int]] = field(default_factory=list)
    """The tokens each verifying sequence was proposed, in row order (speculative decoding)."""


@dataclass(slots=True, eq=False)
class StepHandle:
    """A launched step whose sampled ids may still be on their way to the host (vLLM's
    AsyncModelRunnerOutput): `ModelRunner.collect` turns it into the step's `StepOutput`."""

    sampled: SampledBatch | None = None
    """The sampled rows: ids on the device, their copy to the host under way."""
    takers: list[tuple[SeqState, int]] = field(default_factory=list)
    """(sequence, its first row) of each sampling sequence: it appends that row's token."""
    verifiers: list[Verifier] = field(default_factory=list)
    """The sequences verifying a proposal (speculative decoding)."""
    beams: list[list[BeamCandidate]] = field(default_factory=list)
    deferrable: bool = False
    """The engine may launch its next step before reading this one's results (async scheduling):
    every row is one sample's own (no n > 1 fan-out, no beams) and its sampling reads only its
    logits (no grammar, penalties or min_tokens, which read the output so far); no tensor
    parallelism."""

    @property
    def token_ids(self) -> torch.Tensor | None:
        """[rows] int64 sampled ids on the device (None: the step sampled nothing)."""
        return None if self.sampled is None else self.sampled.token_ids


@dataclass(slots=True, eq=False)
class Verifier:
    """A sequence verifying the tokens proposed after its last one (speculative decoding).

    Its 1 + k rows sample each position as any row would: row j's logits follow the proposal's
    first j tokens. It keeps the proposed tokens up to the first that differs from its row's
    sample, then that row's sample (all k match: the last row's). For a greedy row that is the
    longest prefix equal to the argmax; for a random one it is Leviathan et al.'s rule for a
    proposal that puts all its mass on one token: the proposed token is kept with probability
    p(token), and otherwise the row's sample is a draw from p without it, which is what the
    exponential race gives conditioned on not choosing it (engine/sample/sampler.py). The
    output's distribution is the target's, and a seeded sample's generator is rewound to the
    positions kept, so it gives the same tokens as without speculation."""

    state: SeqState
    row: int
    """Its first row."""
    drafts: list[int]
    generator_state: torch.Tensor | None = None
    """A seeded random sample's generator before the step's draws (to rewind it)."""

    def accepted(self, token_ids: list[int]) -> int:
        """Proposed tokens kept, given the step's sampled rows."""
        return num_accepted(self.drafts, token_ids, self.row)


def num_accepted(drafts: list[int], token_ids: list[int], row: int) -> int:
    """The longest prefix of `drafts` equal to the sampled rows token_ids[row:]."""
    a = 0
    for j, d in enumerate(drafts):
        if token_ids[row + j] != d:
            break
        a = j + 1
    return a


@dataclass(slots=True)
class _SamplingPlan:
    """The rows a step samples, known before its forward pass."""

    rows: list[SamplingRow]
    row_index: list[int]
    """Flat token index of each row's logits."""
    takers: list[tuple[SeqState, int]]
    """(sequence, its first row) of each sampling sequence."""
    beam_index: list[int] = field(default_factory=list)
    """Flat token index of each beam row's logits (after the sampled rows' in the logits)."""
    verifiers: list[Verifier] = field(default_factory=list)


@dataclass(eq=False, repr=False)
class ModelRunner:
    model: Any
    backend: AttentionBackend
    kv_cache: torch.Tensor
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]"""
    sampler: Sampler
    block_size: int
    eos_token_ids: tuple[int, ...]
    device: torch.device
    _: KW_ONLY
    offload: Offload | None = None
    """Carries out a plan's CPU and disk copies (engine/kv_io/offload.py); None: no tiers."""
    tensor_parallel: bool = False
    """Ranks 1..N-1 run each step too (the executor passes `launch` how to send it to them)."""
    max_graph_batch: int = 0
    """Largest decode batch to capture as a CUDA graph (engine/worker/cuda_graphs.py); 0: none.
    Captured only on CUDA, with the cupy backend, without tensor parallelism, for families whose
    forward never syncs with the host (`supports_cuda_graphs`)."""
    max_model_len: int = 0
    """Longest sequence (sizes the graphs' block tables and decode launches)."""
    drafter: DraftRunner | None = None
    """Speculative decoding's draft model (method draft_model): runs over every step's tokens
    and makes the proposals the record asks for (engine/worker/draft_runner.py)."""
    graphs: DecodeGraphs | None = field(init=False, default=None)
    inputs: InputBatch = field(init=False)
    """The step's flat batch, in buffers that persist across steps."""
    seqs: SeqStates = field(init=False)
    """Every sequence the core has told this worker of (engine/worker/seq_state.py)."""
    _plan_key: tuple[list[int], list[int], list[int]] | None = field(init=False, default=None)
    _plan: _SamplingPlan | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.inputs = InputBatch(self.block_size, self.device)
        self.seqs = SeqStates(self.device)
        if (
            self.max_graph_batch > 0
            and self.device.type == "cuda"
            and not self.tensor_parallel
            and self.backend.name == "cupy"
            and getattr(self.model, "supports_cuda_graphs", False)
            # not where the backend falls back to the torch reference (it syncs with the host)
            and self.backend.supports(self.model.head_dim, self.block_size, self.model.dtype)
        ):
            self.graphs = DecodeGraphs(
                self.model,
                self.backend,
                self.kv_cache,
                self.block_size,
                self.max_model_len,
                graph_sizes(self.max_graph_batch),
            )
            self.graphs.capture()

    def apply_plan(self, plan: KVPlan) -> None:
        apply_plan(plan, self.kv_cache, self.offload, self.backend)
        if self.drafter is not None:  # the plan's copy-on-write, on the draft's cache too
            apply_plan(plan, self.drafter.kv_cache, None, self.drafter.backend)

    def execute(self, record: StepRecord) -> StepOutput:
        """One step, start to end: `launch`, then `collect`."""
        return self.collect(self.launch(record))

    @torch.inference_mode()
    def launch(
        self,
        record: StepRecord,
        in_flight: StepHandle | None = None,
        followers: Followers | None = None,
    ) -> StepHandle:
        """One forward over every scheduled token, then the sampler where a chunk reaches a
        sequence's end; returns without waiting for the GPU (the host waits in `collect`).

        `in_flight`: the step launched before this one and not yet collected (async scheduling);
        a sequence's pending token is read from its sampled ids on the device. `followers`:
        sends the step to ranks 1..N-1 before rank 0's forward (tensor parallelism).
        """
        states = self.seqs.update(record)
        self.apply_plan(record.plan)
        if not states:
            if followers is not None and record.plan:
                followers(record.plan, None, [])
            return StepHandle()
        pending = None if in_flight is None else in_flight.token_ids
        drafts = record.drafts
        if self.drafter is not None:
            drafts = {**drafts, **self.drafter.run(states, record, pending)}
        step = self.inputs.build(
            states, record.starts, record.num_new_tokens, record.block_tables, pending, drafts
        )
        self.backend.prepare(step.meta)
        plan = self._sampling_plan(record, states, drafts)
        if followers is not None:
            rows = plan.row_index + plan.beam_index
            followers(record.plan, StepBatch.of(self.inputs, step), rows)
        mask = record.token_mask
        try:
            index = plan.row_index + plan.beam_index
            # One row per sampling sequence (no n > 1 fan-out, no beams): the rows' token indexes
            # strictly increase, so T of them are 0..T-1, every token in order (pure decode).
            one_each = not plan.beam_index and len(plan.rows) == len(plan.takers)
            logits = self.run_model(step, index, one_each)
            if logits is None:
                return StepHandle()
            packed = mask.result() if mask is not None else None
        except BaseException:
            if mask is not None:  # a fill in flight finishes first (its buffer is reused)
                mask.wait()
            raise
        handle = StepHandle(takers=plan.takers, verifiers=plan.verifiers)
        if record.beams:
            handle.beams = self._rank_beams(logits[len(plan.rows) :], record)
        for v in plan.verifiers:
            srow = plan.rows[v.row]
            if srow.generator is not None and not srow.greedy:
                v.generator_state = srow.generator.get_state()
        if plan.rows:
            rows_logits = logits[: len(plan.rows)]
            handle.sampled = self.sampler.sample(rows_logits, plan.rows, self.eos_token_ids, packed)
        handle.deferrable = (
            followers is None
            and one_each
            and mask is None
            and not (plan.rows and self.sampler.needs_history(plan.rows))
        )
        if handle.deferrable:
            for state, row in plan.takers:
                state.pending_row = row
        return handle

    def collect(self, handle: StepHandle) -> StepOutput:
        """The launched step's results on the host (waits for its sampled ids); each sampling
        sequence appends its token."""
        out = StepOutput(beams=handle.beams, drafts=[v.drafts for v in handle.verifiers])
        if handle.sampled is not None:
            host = handle.sampled.to_host()
            out.token_ids, out.logprobs = host.token_ids, host.logprobs
            token_ids = host.token_ids
            for state, row in handle.takers:
                state.token_ids.append(token_ids[row])
            for v in handle.verifiers:
                a = v.accepted(token_ids)
                state = v.state
                if state.draft_len is not None:  # the draft's KV holds the kept tokens only
                    state.draft_len = min(state.draft_len, len(state.token_ids) + a)
                state.token_ids.extend(token_ids[v.row : v.row + a + 1])
                if v.generator_state is not None and a < len(v.drafts):
                    self._rewind(v, a + 1)
        return out

    def _rewind(self, v: Verifier, kept: int) -> None:
        """Puts a seeded sample's generator where `kept` positions' draws leave it (the sampler
        drew one exponential vector per row; the rows past the kept ones are dropped)."""
        assert v.generator_state is not None
        generator = v.state.request.generators[v.state.index]
        assert generator is not None
        generator.set_state(v.generator_state)
        draw = torch.empty(self.sampler.vocab_size, dtype=torch.float32, device=self.device)
        for _ in range(kept):
            draw.exponential_(generator=generator)

    def run_model(self, step: StepInputs, index: list[int], one_each: bool) -> torch.Tensor | None:
        """The forward over every scheduled token, then the logits [len(index), V] float32 of the
        flat tokens `index` (None when there are none). `one_each`: index is every token in order.

        A pure-decode step replays a captured CUDA graph where one fits (its logits cover every
        row); any other step runs the model eagerly."""
        if self.graphs is not None:
            full = self.graphs.run(step.input_ids, step.positions, step.meta)
            if full is not None:
                if not index:
                    return None
                if one_each and len(index) == full.shape[0]:
                    return full
                return full.index_select(0, _index_tensor(index, full.device))
        hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)  # [T, hidden]
        if not index:
            return None
        if one_each and len(index) == hidden.shape[0]:
            rows = hidden
        else:
            rows = hidden.index_select(0, _index_tensor(index, hidden.device))
        logits: torch.Tensor = self.model.compute_logits(rows)  # [rows, vocab] fp32
        return logits

    def _rank_beams(self, logits: torch.Tensor, record: StepRecord) -> list[list[BeamCandidate]]:
        """logits: [beam rows, V'] in the record's beam order -> each ranking's candidates."""
        rows: list[BeamRows] = []
        start = 0
        for b in record.beams:
            n = len(b.seq_ids)
            rows.append(
                BeamRows(list(range(start, start + n)), b.scores, b.num_candidates, b.banned)
            )
            start += n
        return top_candidates(logits, self.sampler.vocab_size, rows)

    def _sampling_plan(
        self, record: StepRecord, states: list[SeqState], drafts: dict[int, list[int]]
    ) -> _SamplingPlan:
        """The step's sampling rows. A step that samples the same sequences as the one before,
        one row each (a steady decode), reuses that step's plan: its rows live as long as their
        sequences."""
        key = (record.seq_ids, record.num_new_tokens, record.samples)
        steady = not record.fan_out and not record.beams and not drafts
        if steady and self._plan is not None and self._plan_key == key:
            return self._plan
        plan = self._new_sampling_plan(record, states, drafts)
        self._plan_key, self._plan = (key, plan) if steady else (None, plan)
        return plan

    def _new_sampling_plan(
        self, record: StepRecord, states: list[SeqState], drafts: dict[int, list[int]]
    ) -> _SamplingPlan:
        plan = _SamplingPlan([], [], [])
        rows, row_index, takers = plan.rows, plan.row_index, plan.takers
        num_new = record.num_new_tokens
        decode = sum(num_new) == len(num_new)  # one token each: its end is its index + 1
        ends = range(1, len(num_new) + 1) if decode else list(itertools.accumulate(num_new))
        fan_out = record.fan_out
        for i in record.samples:
            state = states[i]
            end = ends[i] - 1
            proposed = drafts.get(i) if drafts else None
            if proposed:  # a row at its last token and at each proposed one
                k = len(proposed)
                plan.verifiers.append(Verifier(state, len(rows), proposed))
                rows.extend([state.row or state.sampling_row()] * (k + 1))
                row_index.extend(range(end - k, end + 1))
                continue
            n = fan_out.get(i, 1) if fan_out else 1
            takers.append((state, len(rows)))
            if n == 1:
                rows.append(state.row or state.sampling_row())
                row_index.append(end)
            else:  # the first token of n samples: they fork after it
                rows.extend(state.first_rows(n))
                row_index.extend([end] * n)
        if record.beams:
            # NOTE: the scheduler runs a group's beams in lockstep: all of them rank together.
            end_of = {seq_id: ends[i] - 1 for i, seq_id in enumerate(record.seq_ids)}
            for b in record.beams:
                plan.beam_index.extend(end_of[s] for s in b.seq_ids)
        return plan


def _index_tensor(index: list[int], device: torch.device) -> torch.Tensor:
    return host_to_device(index, torch.int64, device)


def apply_plan(plan: KVPlan, kv_cache: torch.Tensor, offload: Offload | None, backend: Any) -> None:
    """A step's KV plan on one rank's cache: the CPU and disk tiers' copies, then copy-on-write
    (every rank, before its forward)."""
    if offload is not None and (
        plan.disk_store or plan.spill or plan.disk_load or plan.remote_load or plan.swap_in
    ):
        offload.apply(plan, kv_cache)
    if plan.cow:
        src = host_to_device([s for s, _ in plan.cow], torch.int64, kv_cache.device)
        dst = host_to_device([d for _, d in plan.cow], torch.int64, kv_cache.device)
        backend.copy_blocks(kv_cache, src, dst)
