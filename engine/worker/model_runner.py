"""Builds the flat batch of a step, carries out the KV plan, runs the model and the sampler."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from engine.kv.plan import KVPlan
from engine.outputs import TokenLogprob
from engine.sample.beam import BeamCandidate, BeamRows, top_candidates
from engine.sample.sampler import (
    OutputTokens,
    SampledBatch,
    Sampler,
    SamplingRow,
    host_to_device,
)
from engine.sample.structured.mask_filler import PendingMask, TokenMaskFiller
from engine.worker.attention.base import AttentionBackend
from engine.worker.cuda_graphs import DecodeGraphs, graph_sizes
from engine.worker.input_batch import InputBatch, StepInputs
from engine.worker.parallel.step import StepBatch

if TYPE_CHECKING:  # the core's step types; the worker only reads them
    from engine.core.scheduler import ScheduledSeq, SchedulerOutput
    from engine.core.sequence import Request, Sequence
    from engine.worker.parallel.executor import TPExecutor


class Offload(Protocol):
    """Carries out the CPU/disk parts of a plan (engine/kv_io/offload.py)."""

    def apply(self, plan: KVPlan, kv_cache: torch.Tensor) -> None: ...


def _token_filter(req: Request) -> np.ndarray | None:
    g = req.compiled_grammar
    return None if g is None else g.token_filter


@dataclass(slots=True)
class BeamSamples:
    """A beam group's ranked continuations (engine/core/beam.py decides what runs on)."""

    request: Request
    beams: list[Sequence]
    """The group's running beams, in the order `candidates` name them."""
    candidates: list[BeamCandidate]
    """The K best continuations, best first."""


@dataclass(slots=True)
class StepOutput:
    """What one step sampled (vLLM's ModelRunnerOutput): flat lists in row order, so the core
    walks them once without a result object per sequence."""

    owners: list[tuple[ScheduledSeq, int]] = field(default_factory=list)
    """(item, number of rows) in row order: n rows for a request's first token (before its n
    samples fork), else 1."""
    token_ids: list[int] = field(default_factory=list)
    """One sampled token per row."""
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """Per row; None where neither logprobs nor best_of's ranking asks for them."""
    beams: list[BeamSamples] = field(default_factory=list)
    """The beam groups that ranked their continuations this step."""


@dataclass(slots=True, eq=False)
class StepHandle:
    """A launched step whose sampled ids may still be on their way to the host (vLLM's
    AsyncModelRunnerOutput): `ModelRunner.collect` turns it into the step's `StepOutput`."""

    owners: list[tuple[ScheduledSeq, int]] = field(default_factory=list)
    """(item, number of rows) in row order, as `StepOutput.owners`."""
    sampled: SampledBatch | None = None
    """The sampled rows: ids on the device, their copy to the host under way."""
    beams: list[BeamSamples] = field(default_factory=list)
    deferrable: bool = False
    """The engine may launch its next step before reading this one's results (async scheduling):
    every row is one sample's own (no n > 1 fan-out, no beams) and its sampling reads only its
    logits (no grammar, penalties or min_tokens, which read the output so far); no tensor
    parallelism."""

    @property
    def token_ids(self) -> torch.Tensor | None:
        """[rows] int64 sampled ids on the device (None: the step sampled nothing)."""
        return None if self.sampled is None else self.sampled.token_ids


@dataclass(slots=True)
class _SamplingPlan:
    """The rows a step samples, known before its forward pass."""

    rows: list[SamplingRow]
    row_index: list[int]
    """Flat token index of each row's logits."""
    owners: list[tuple[ScheduledSeq, int]]
    """(item, number of rows), in row order."""
    matchers: list[Any]
    """Each row's grammar matcher or None; empty when no row has a grammar (structured
    outputs)."""
    filters: list[np.ndarray | None]
    """Each row's static token filter or None; empty as `matchers` is."""
    beam_index: list[int] = field(default_factory=list)
    """Flat token index of each beam row's logits (after the sampled rows' in the logits)."""
    beam_groups: list[tuple[Request, list[Sequence]]] = field(default_factory=list)
    """Beam-search requests that rank this step, with their running beams in row order."""


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
    tp: TPExecutor | None = None
    """Ranks 1..N-1 under tensor parallelism: each step goes to them before the forward."""
    max_graph_batch: int = 0
    """Largest decode batch to capture as a CUDA graph (engine/worker/cuda_graphs.py); 0: none.
    Captured only on CUDA, with the cupy backend, without tensor parallelism, for families whose
    forward never syncs with the host (`supports_cuda_graphs`)."""
    max_model_len: int = 0
    """Longest sequence (sizes the graphs' block tables and decode launches)."""
    graphs: DecodeGraphs | None = field(init=False, default=None)
    masks: TokenMaskFiller = field(init=False)
    """Fills the structured-output token mask while the forward runs."""
    inputs: InputBatch = field(init=False)
    """The step's flat batch, in buffers that persist across steps."""

    def __post_init__(self) -> None:
        self.inputs = InputBatch(self.block_size, self.device)
        self.masks = TokenMaskFiller(
            self.sampler.vocab_size, unpack_on_host=self.device.type == "cpu"
        )
        if (
            self.max_graph_batch > 0
            and self.device.type == "cuda"
            and self.tp is None
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
        if self.offload is not None and (
            plan.disk_store or plan.spill or plan.disk_load or plan.swap_in
        ):
            self.offload.apply(plan, self.kv_cache)
        if plan.cow:
            src = host_to_device([s for s, _ in plan.cow], torch.int64, self.device)
            dst = host_to_device([d for _, d in plan.cow], torch.int64, self.device)
            self.backend.copy_blocks(self.kv_cache, src, dst)

    def execute(self, sched: SchedulerOutput, tables: list[list[int]]) -> StepOutput:
        """One step, start to end: `launch`, then `collect`."""
        return self.collect(self.launch(sched, tables))

    @torch.inference_mode()
    def launch(
        self,
        sched: SchedulerOutput,
        tables: list[list[int]],
        in_flight: torch.Tensor | None = None,
    ) -> StepHandle:
        """One forward over every scheduled token, then the sampler where a chunk reaches a
        sequence's end; returns without waiting for the GPU (the host waits in `collect`).

        `tables` holds each scheduled sequence's block ids, in `sched.scheduled` order.
        `in_flight`: the sampled ids of the step launched before this one and not yet collected
        (async scheduling); a sequence's pending token is read from it on the device.
        """
        self.apply_plan(sched.plan)
        if not sched.scheduled:
            if self.tp is not None and sched.plan:
                self.tp.send_step(sched.plan, None, [])
            return StepHandle()
        step = self.inputs.build(sched.scheduled, tables, in_flight)
        self.backend.prepare(step.meta)
        plan = self._sampling_plan(sched.scheduled)
        if self.tp is not None:
            rows = plan.row_index + plan.beam_index
            self.tp.send_step(sched.plan, StepBatch.of(self.inputs, step), rows)
        # The grammar masks fill on a worker thread while the model runs.
        pending = self.masks.start(plan.matchers, plan.filters) if plan.matchers else None
        try:
            index = plan.row_index + plan.beam_index
            # One row per sampling item (no n > 1 fan-out, no beams): the rows' token indexes
            # strictly increase, so T of them are 0..T-1, every token in order (pure decode).
            one_each = not plan.beam_index and len(plan.rows) == len(plan.owners)
            logits = self.run_model(step, index, one_each)
            if logits is None:
                return StepHandle()
            mask = pending.result() if pending is not None else None
        except BaseException:
            _settle(pending)
            raise
        handle = StepHandle(plan.owners)
        if plan.beam_groups:
            handle.beams = self._rank_beams(logits[len(plan.rows) :], plan.beam_groups)
        if plan.rows:
            rows_logits = logits[: len(plan.rows)]
            handle.sampled = self.sampler.sample(rows_logits, plan.rows, self.eos_token_ids, mask)
        handle.deferrable = (
            self.tp is None
            and one_each
            and not plan.matchers
            and not (plan.rows and self.sampler.needs_history(plan.rows))
        )
        return handle

    @staticmethod
    def collect(handle: StepHandle) -> StepOutput:
        """The launched step's results on the host (waits for its sampled ids)."""
        out = StepOutput(handle.owners, beams=handle.beams)
        if handle.sampled is not None:
            host = handle.sampled.to_host()
            out.token_ids, out.logprobs = host.token_ids, host.logprobs
        return out

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

    def _rank_beams(
        self, logits: torch.Tensor, groups: list[tuple[Request, list[Sequence]]]
    ) -> list[BeamSamples]:
        """logits: [beam rows, V'] in `groups` order -> each group's ranked candidates."""
        rows: list[BeamRows] = []
        start = 0
        for req, beams in groups:
            p, group = req.params, req.beam
            assert group is not None
            held = beams[0].num_output_tokens < p.min_tokens
            rows.append(
                BeamRows(
                    rows=list(range(start, start + len(beams))),
                    scores=[s.cum_logprob for s in beams],
                    k=group.num_candidates,
                    banned=sorted(group.finishing) if held else [],
                )
            )
            start += len(beams)
        ranked = top_candidates(logits, self.sampler.vocab_size, rows)
        return [
            BeamSamples(req, beams, cands)
            for (req, beams), cands in zip(groups, ranked, strict=True)
        ]

    def _sampling_plan(self, scheduled: list[ScheduledSeq]) -> _SamplingPlan:
        plan = _SamplingPlan([], [], [], [], [])
        rows, row_index, owners = plan.rows, plan.row_index, plan.owners
        end = 0
        beam_rows: dict[int, int] = {}
        """seq_id -> flat token index of a beam's logits."""
        for item in scheduled:
            end += item.num_new_tokens
            seq = item.seq
            if item.start + item.num_new_tokens != len(seq.token_ids) + seq.num_pending:
                continue  # a prefill chunk short of the prompt's end: nothing to sample
            req = seq.request
            row = seq.sampling_row
            if row is not None:  # a running sample: the same row every step
                rows.append(row)
                row_index.append(end - 1)
                owners.append((item, 1))
                continue
            if req.beam is not None:
                beam_rows[seq.seq_id] = end - 1
                if all(r is not req for r, _ in plan.beam_groups):
                    plan.beam_groups.append((req, list(req.seqs)))
                continue
            n = req.params.num_samples if not req.forked else 1
            if n > 1:  # the first token of n samples: they fork after it
                prompt = req.prompt_token_ids
                rows.extend(
                    SamplingRow(req.params, prompt, [], req.generators[i]) for i in range(n)
                )
                row_index.extend([end - 1] * n)
            else:
                # One row a sample, kept for its life (its output tokens are a live view).
                row = seq.sampling_row = SamplingRow(
                    req.params,
                    req.prompt_token_ids,
                    OutputTokens(seq.token_ids, seq.num_prompt_tokens),
                    req.generators[seq.index],
                )
                rows.append(row)
                row_index.append(end - 1)
            owners.append((item, n))
        if any(item.seq.grammar is not None for item, _ in owners):  # structured outputs
            for item, n in owners:
                plan.matchers += [item.seq.grammar] * n
                plan.filters += [_token_filter(item.seq.request)] * n
        for _, beams in plan.beam_groups:
            # NOTE: the scheduler runs a group's beams in lockstep: all of them sample together.
            plan.beam_index.extend(beam_rows[s.seq_id] for s in beams)
        return plan

    def close(self) -> None:
        """Stops the mask worker and the tensor-parallel workers."""
        self.masks.close()
        if self.tp is not None:
            self.tp.close()


def _index_tensor(index: list[int], device: torch.device) -> torch.Tensor:
    return host_to_device(index, torch.int64, device)


def _settle(pending: PendingMask | None) -> None:
    """Lets a fill in flight finish before an error leaves the step (the buffer is reused)."""
    if pending is not None:
        pending.wait()
