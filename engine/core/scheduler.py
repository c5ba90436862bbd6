"""Continuous batching with one token budget per step, chunked prefill and preemption.

Each step:
1. Running sequences, oldest first, get their next token (decode) or the next chunk of an
   unfinished prefill, while the budget lasts. When the pool is short, the newest running
   sequence is preempted (recompute: its blocks are freed and it goes back to the front of the
   waiting queue; its cached blocks stay findable, so it comes back through the prefix cache).
2. If nothing was preempted, waiting sequences are admitted first come, first served, each with
   its longest cached prefix and as much of the rest of its prompt as the budget allows. The
   queue does not skip: when the head does not fit, admission stops for this step. The one
   exception: a request whose grammar is still compiling, or whose remote-tier lookup is still
   running, is stepped over (it keeps its place).
A sequence that can never fit (it needs more blocks than the whole pool) finishes with an error
instead of blocking the queue.

Async scheduling (engine/core/engine_core.py): a running sample may have a token in flight (sampled
by a step whose ids are not on the host yet, `Sequence.num_pending`); it counts towards the
sequence's length, so the sample's next decode is that token's. A sample whose token in flight
reaches its max length is not scheduled (it ends when the token arrives), and a preempted one is
not readmitted before its token is in.

Beam search: a request's running beams are one *unit*, adjacent in `running` and in `waiting`.
A unit is scheduled, preempted (always by recompute) and admitted as a whole, and its beams reach
their last token in the same step (lockstep): the step's ranking needs every beam's logits. When
the budget cannot take every beam's remaining tokens, each beam gets a chunk that stops short of
its last token. Blocks are checked for the whole unit before any beam allocates.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from engine.config import SchedulerConfig
from engine.core.output_processor import OutputProcessor
from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.core.sequence import SeqStatus, Sequence
from engine.core.step_records import RecordedStep
from engine.core.step_update import StepUpdate
from engine.kv.manager import KVCacheManager, PrefixMatch
from engine.kv.tiers import TieredCache
from engine.worker.model_runner import StepOutput

if TYPE_CHECKING:
    from engine.core.spec.proposer import Proposer


class Scheduler:
    """Decides each step (`schedule`) and applies each step's output (`update_from_output`)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        outputs: OutputProcessor,
        tiers: TieredCache | None = None,
        swap: bool = False,
        proposer: Proposer | None = None,
    ) -> None:
        """`tiers`: the CPU and disk tiers (prompt pins reach them); `swap`: preemption spills
        a sequence's KV to the CPU tier instead of recomputing it; `proposer`: speculative
        decoding's (engine/core/spec/proposer.py), None when it is off."""
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.swap = tiers if swap else None
        """In swap preemption mode: preempted sequences' KV goes to this CPU tier."""
        self.proposer = proposer
        self._update = StepUpdate(self, kv, outputs, tiers, proposer)

    def update_from_output(
        self, step: RecordedStep, out: StepOutput, now: float, *, deferred: bool
    ) -> None:
        """A launched step's sampled tokens reach their sequences (engine/core/step_update.py)."""
        self._update.apply(step, out, now, deferred)

    def advance(self, sched: SchedulerOutput) -> tuple[int, int]:
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

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """The sample ends: out of the queues, its blocks freed."""
        self.remove(seq)
        seq.finish(reason, stop_reason)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample joins the running set directly (it shares its parent's blocks)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the queues and frees its blocks (finish, abort, failure)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        if self.swap is not None:
            self.swap.drop_swap(seq.seq_id)

    def regroup(self, old: list[Sequence], new: list[Sequence]) -> None:
        """A beam group's running beams `old` (adjacent in `running`) become `new` in their
        place; beams of `old` not in `new` free their blocks now."""
        start = self.running.index(old[0])
        assert self.running[start : start + len(old)] == old, "a beam group is not adjacent"
        self.running[start : start + len(old)] = new
        kept = {s.seq_id for s in new}
        for seq in new:
            seq.status = SeqStatus.RUNNING
        for seq in old:
            if seq.seq_id not in kept:
                self.kv.free(seq)
                seq.finish("dropped")

    # -- units ---------------------------------------------------------------------------------
    @staticmethod
    def _unit(queue: Seq[Sequence], i: int) -> list[Sequence]:
        """The unit that starts at queue[i]: a beam group's adjacent beams, else one sequence."""
        seq = queue[i]
        if seq.request.beam is None:
            return [seq]
        req = seq.request
        return list(
            itertools.takewhile(lambda s: s.request is req, itertools.islice(queue, i, None))
        )

    def _last_unit(self) -> list[Sequence]:
        """The newest running unit (the preemption victim)."""
        last = self.running[-1]
        if last.request.beam is None:
            return [last]
        i = len(self.running) - 1
        while i > 0 and self.running[i - 1].request is last.request:
            i -= 1
        return self.running[i:]

    @staticmethod
    def _chunks(unit: list[Sequence], remaining: list[int], budget: int) -> list[int]:
        """Tokens each member computes this step. A beam unit either finishes every member's
        tokens or stops each short of its last token (lockstep); a lone sequence chunks freely."""
        if len(unit) == 1:
            return [min(remaining[0], budget)]
        if sum(remaining) <= budget:
            return list(remaining)
        out = []
        for r in remaining:
            take = min(max(0, r - 1), budget)
            out.append(take)
            budget -= take
        return out

    def _fits(
        self, unit: list[Sequence], chunks: list[int], matches: list[PrefixMatch | None]
    ) -> bool:
        """Whether the pool can take the unit's step. A free cached block that several beams
        match is taken once, though each beam's own count includes it."""
        need = sum(
            self.kv.blocks_needed(s, n, m) for s, n, m in zip(unit, chunks, matches, strict=True)
        )
        if len(unit) > 1:
            revived = [b.block_id for m in matches if m for b in m.device_blocks if b.ref_cnt == 0]
            need -= len(revived) - len(set(revived))
        return need <= self.kv.num_free_blocks

    def _can_ever_fit(self, seq: Sequence) -> bool:
        return -(-len(seq.token_ids) // self.kv.block_size) <= self.kv.num_blocks

    def schedule(self) -> SchedulerOutput:
        """Running sequences first (a decode token or the next prefill chunk), then waiting ones
        FCFS, within one token budget; a step that preempted admits nothing new."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return self._finish(out)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedules running units, preempting the newest when blocks run out; returns the
        budget left."""
        i = 0
        running = self.running
        fits_in_place = self.kv.fits_in_place
        scheduled = out.scheduled
        proposer = self.proposer
        if proposer is not None and not proposer.active(len(running)):
            proposer = None
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            pending = seq.num_pending  # tokens in flight (async scheduling)
            length = len(seq.token_ids) + pending
            if pending and length >= seq.max_len:
                i += 1  # the token in flight ends it by length: nothing more to compute
                continue
            if (
                proposer is not None
                and length - computed == 1
                and not pending
                and seq.request.speculates
                and seq.request.forked
                and self._speculate(seq, proposer, budget, len(running) - i - 1, scheduled)
            ):
                budget -= scheduled[-1].num_new_tokens
                i += 1
                continue
            if (
                length - computed == 1 and seq.request.beam is None and fits_in_place(seq)
            ):  # a decode token into a block the sequence holds: nothing to allocate or check
                scheduled.append(ScheduledSeq(seq, 1, computed))
                budget -= 1
                i += 1
                continue
            unit = self._unit(self.running, i)
            chunks = self._chunks(unit, [s.num_uncomputed for s in unit], budget)
            if not any(chunks):
                i += len(unit)
                continue
            nones: list[PrefixMatch | None] = [None] * len(unit)
            while not self._fits(unit, chunks, nones):
                victim = self._last_unit()
                if victim[0] is unit[0]:
                    break
                self._preempt_unit(victim, out)
            else:
                for seq, n in zip(unit, chunks, strict=True):
                    assert self.kv.allocate(seq, n)
                    if n:
                        out.scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
                budget -= sum(chunks)
                i += len(unit)
                continue
            # The pool cannot hold even this unit alone.
            if len(self.running) == len(unit) and not self._can_grow_alone(unit, chunks):
                for seq in unit:
                    self.running.remove(seq)
                    self.kv.free(seq)
                    out.failed.append((seq, self._too_big_message(seq)))
            else:
                self._preempt_unit(unit, out)
            break
        return budget

    def _speculate(
        self,
        seq: Sequence,
        proposer: Proposer,
        budget: int,
        behind: int,
        scheduled: list[ScheduledSeq],
    ) -> bool:
        """Schedules a decoding sample's token with a proposal after it, if it gets one and its
        blocks fit while leaving one free block for each of the `behind` running sequences after
        it (a proposal never costs another sequence its place)."""
        room = min(budget - 1, seq.max_len - len(seq.token_ids) - 1)
        if room <= 0:
            return False
        drafts: list[int] = []
        if proposer.on_worker:  # the draft model proposes during the step
            k = proposer.draft_length(seq, room)
        else:
            drafts = proposer.propose(seq, room)
            k = len(drafts)
        if not k:
            return False
        n = 1 + k
        kv = self.kv
        if kv.blocks_needed(seq, n, None) + behind > kv.num_free_blocks or not kv.allocate(seq, n):
            return False
        scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens, k, drafts))
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admits waiting units in order, each sequence with its longest cached prefix."""
        # Requests whose grammar is still compiling, or whose remote lookup is still running, are
        # set aside and put back in order.
        not_ready: list[Sequence] = []
        limit = self.config.max_num_partial_prefills
        prefilling = sum(1 for item in out.scheduled if item.start < item.seq.num_prompt_tokens)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if limit and prefilling >= limit:
                break
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted with a token in flight: it comes back once the token is in
            if seq.request.waiting_for_grammar or seq.request.waiting_for_remote:
                not_ready.append(self.waiting.popleft())
                continue
            unit = self._unit(self.waiting, 0)
            if len(self.running) + len(unit) > self.config.max_num_seqs:
                break
            if not all(self._can_ever_fit(s) for s in unit):
                self._fail_waiting(unit, out)
                continue
            matches = [
                self.kv.match_prefix(s) if s.num_computed_tokens == 0 else None for s in unit
            ]
            remaining = [
                len(s.token_ids) - s.num_computed_tokens - (m.num_tokens if m else 0)
                for s, m in zip(unit, matches, strict=True)
            ]
            chunks = self._chunks(unit, remaining, budget)
            if not self._fits(unit, chunks, matches):
                if not self.running and not out.scheduled:
                    # Nothing else holds blocks: only cached free blocks stand in the way,
                    # and allocate already counts those as free. The unit alone is too big.
                    self._fail_waiting(unit, out)
                    continue
                break
            for seq, num_new, match in zip(unit, chunks, matches, strict=True):
                self.waiting.popleft()
                if len(unit) > 1 and match is not None:
                    # An earlier beam's blocks may have evicted a cached block this one matched:
                    # match again (the unit's block check above still bounds what it takes).
                    match = self.kv.match_prefix(seq)
                    num_new = min(num_new, len(seq.token_ids) - match.num_tokens)
                assert self.kv.allocate(seq, num_new, match)
                if self.swap is not None and match is not None:
                    # A swapped-out sequence: its partial tail comes back from the CPU tier too.
                    block_ids = self.kv.block_ids(seq.seq_id)
                    num_new -= self.swap.resume(
                        seq, match.num_blocks, num_new, block_ids, self.kv.plan
                    )
                if seq.index == 0 and seq.num_preemptions == 0:
                    self._record_hit(seq, match)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                metrics = seq.request.metrics
                if metrics.first_scheduled is None:  # its queue time ends here
                    metrics.first_scheduled = time.monotonic()
                if num_new:
                    out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
                budget -= num_new
            prefilling += 1
        self.waiting.extendleft(reversed(not_ready))

    def _fail_waiting(self, unit: list[Sequence], out: SchedulerOutput) -> None:
        for seq in unit:
            self.waiting.popleft()
            out.failed.append((seq, self._too_big_message(seq)))

    def _record_hit(self, seq: Sequence, match: PrefixMatch | None) -> None:
        if match is None:
            match = PrefixMatch(block_size=self.kv.block_size)
        self.kv.record_admission(len(seq.token_ids), match)
        by_tier = match.tokens_by_tier()
        ct = seq.request.cached_tokens
        ct.device, ct.cpu, ct.disk = by_tier["device"], by_tier["cpu"], by_tier["disk"]
        ct.remote = by_tier["remote"]

    def _can_grow_alone(self, unit: list[Sequence], chunks: list[int]) -> bool:
        bs = self.kv.block_size
        need = sum(-(-(s.num_computed_tokens + n) // bs) for s, n in zip(unit, chunks, strict=True))
        return need <= self.kv.num_blocks

    def _too_big_message(self, seq: Sequence) -> str:
        cap = self.kv.num_blocks * self.kv.block_size
        return (
            f"the request needs {len(seq.token_ids)} tokens of KV cache but the pool holds "
            f"{cap}; shorten the prompt or max_tokens, or give the engine more KV blocks"
        )

    def _preempt_unit(self, unit: list[Sequence], out: SchedulerOutput) -> None:
        """Preempts a unit; its members keep their order at the front of the waiting queue."""
        for seq in reversed(unit):
            self._preempt(seq, out)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Frees the blocks and requeues the sequence at the front of the waiting queue.

        Recompute (default): its cached blocks stay findable, so it comes back through the prefix
        cache. Swap: its computed blocks are first spilled to the CPU tier and held there until it
        comes back (the partial tail too); when the CPU tier is full this falls back to recompute.
        """
        self.running.remove(seq)
        if self.swap is not None and seq.request.beam is None:  # beams always recompute
            self.swap.swap_out(seq, self.kv.block_ids(seq.seq_id), self.kv.plan)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    @staticmethod
    def _lockstep(out: SchedulerOutput) -> None:
        """A beam group ranks only when every beam reaches its last token in the step; where
        one does not (a re-matched prefix came out shorter), the others stop one token short."""
        groups: dict[str, list[ScheduledSeq]] = {}
        for item in out.scheduled:
            req = item.seq.request
            if req.beam is not None and item.samples:
                groups.setdefault(req.request_id, []).append(item)
        late = False
        for items in groups.values():
            if len(items) < len(items[0].seq.request.seqs):
                for item in items:
                    item.num_new_tokens -= 1
                    late = True
        if late:
            out.scheduled = [item for item in out.scheduled if item.num_new_tokens > 0]

    def _finish(self, out: SchedulerOutput) -> SchedulerOutput:
        self._lockstep(out)
        if self.swap is not None:
            for seq, _ in out.failed:
                self.swap.drop_swap(seq.seq_id)
        out.plan = self.kv.take_plan()
        return out
