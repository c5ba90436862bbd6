"""From the scheduler's decision to the plain record the workers run (engine/worker/
step_record.py), and what the core keeps to read the step's results back.

Each scheduled sequence goes into the record by id with its position, token count and block
table; a sequence the workers have not seen goes in once in full (`NewSequence`). The sequences
whose chunk reaches their last token sample: one row each, or n rows for a request's first token
before its n samples fork; a beam-search request ranks its running beams instead. The core keeps
those rows' owners (`owners`) and the beam groups, in the same order, to apply the step's output.
Structured outputs: the grammar matchers live here, so the token mask of the sampling rows starts
filling here, on the mask filler's thread, before the workers run the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.core.sequence import Request, Sequence
from engine.sample.structured.mask_filler import TokenMaskFiller
from engine.worker.step_record import BeamRanking, NewSequence, StepRecord


@dataclass(slots=True)
class RecordedStep:
    """A step's record and what the core needs to apply its output."""

    record: StepRecord
    owners: list[tuple[ScheduledSeq, int]] = field(default_factory=list)
    """(item, rows) of every sampling sequence, in row order (1 + its proposal's length for a
    sample verifying one)."""
    beam_groups: list[tuple[Request, list[Sequence]]] = field(default_factory=list)
    """Each ranking beam-search request with its running beams, in the record's beam order."""


class StepRecords:
    """Builds each step's record; collects between steps what the workers must learn or forget."""

    def __init__(self, vocab_size: int, device_type: str) -> None:
        self.masks = TokenMaskFiller(vocab_size, unpack_on_host=device_type == "cpu")
        """Fills the structured-output token mask while the step's forward runs."""
        self._finished: list[int] = []
        self._appended: list[tuple[int, int]] = []

    def forget(self, req: Request) -> None:
        """The request has ended: the workers drop its sequences with the next record."""
        self._finished += req.worker_seq_ids
        req.worker_seq_ids = []

    def appended(self, seq: Sequence) -> None:
        """The core appended `seq`'s newest token without the workers sampling it (beams)."""
        if seq.on_worker:
            self._appended.append((seq.seq_id, seq.token_ids[-1]))

    def build(self, sched: SchedulerOutput, tables: list[list[int]]) -> RecordedStep:
        scheduled = sched.scheduled
        seqs = [item.seq for item in scheduled]
        record = StepRecord(
            sched.plan,
            [seq.seq_id for seq in seqs],
            [item.num_new_tokens for item in scheduled],
            [item.start for item in scheduled],
            tables,
        )
        record.finished, self._finished = self._finished, []
        record.appended, self._appended = self._appended, []
        if not all([seq.on_worker for seq in seqs]):
            for seq in seqs:
                if not seq.on_worker:
                    self._introduce(seq, record)
        step = RecordedStep(record)
        owners, samples, fan_out = step.owners, record.samples, record.fan_out
        for i, item in enumerate(scheduled):
            seq = item.seq
            k = item.num_drafts
            if item.start + item.num_new_tokens - k != len(seq.token_ids) + seq.num_pending:
                continue  # a prefill chunk short of the prompt's end: nothing to sample
            req = seq.request
            if k:  # a running sample verifying a proposal: a row per position
                samples.append(i)
                owners.append((item, 1 + k))
                if item.drafts:
                    record.drafts[i] = list(item.drafts)
                else:  # the worker's draft model proposes them
                    record.propose[i] = k
            elif req.forked and req.beam is None:  # a running sample: one row, the common case
                samples.append(i)
                owners.append((item, 1))
            elif req.beam is not None:
                if all(r is not req for r, _ in step.beam_groups):
                    step.beam_groups.append((req, list(req.seqs)))
            else:  # a request's first token: n rows, its samples fork after it
                rows = req.params.num_samples
                if rows > 1:
                    fan_out[i] = rows
                samples.append(i)
                owners.append((item, rows))
        if step.beam_groups:
            record.beams = [_ranking(req, beams) for req, beams in step.beam_groups]
        if any(item.seq.grammar is not None for item, _ in owners):
            record.token_mask = self._start_mask(owners)
        return step

    @staticmethod
    def _introduce(seq: Sequence, record: StepRecord) -> None:
        req = seq.request
        record.new_seqs.append(
            NewSequence(
                seq.seq_id,
                req.request_id,
                seq.index,
                list(seq.token_ids),
                seq.num_prompt_tokens,
                req.params,
            )
        )
        seq.on_worker = True
        req.worker_seq_ids.append(seq.seq_id)

    def _start_mask(self, owners: list[tuple[ScheduledSeq, int]]) -> Any:
        """Starts filling the rows' token mask (structured outputs), one row per sampled row
        (a sample verifying proposed tokens: a row per position, each after the tokens before
        it)."""
        matchers: list[Any] = []
        filters: list[Any] = []
        proposals: dict[int, Any] = {}
        for item, n in owners:
            grammar = item.seq.request.compiled_grammar
            if item.drafts and item.seq.grammar is not None:
                proposals[len(matchers)] = item.drafts
            matchers += [item.seq.grammar] * n
            filters += [None if grammar is None else grammar.token_filter] * n
        return self.masks.start(matchers, filters, proposals)

    def close(self) -> None:
        """Stops the mask filler's thread."""
        self.masks.close()


def _ranking(req: Request, beams: list[Sequence]) -> BeamRanking:
    group = req.beam
    assert group is not None
    held = beams[0].num_output_tokens < req.params.min_tokens
    return BeamRanking(
        [s.seq_id for s in beams],
        [s.cum_logprob for s in beams],
        group.num_candidates,
        sorted(group.finishing) if held else [],
    )
