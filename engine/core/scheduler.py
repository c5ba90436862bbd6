"""Continuous batching with one token budget per step, chunked prefill and preemption.

Each step:
1. Running sequences, oldest first, get their next token (decode) or the next chunk of an
   unfinished prefill, while the budget lasts. When the pool is short, the newest running
   sequence is preempted (recompute: its blocks are freed and it goes back to the front of the
   waiting queue; its cached blocks stay findable, so it comes back through the prefix cache).
2. If nothing was preempted, waiting sequences are admitted first come, first served, each with
   its longest cached prefix and as much of the rest of its prompt as the budget allows. The
   queue does not skip: when the head does not fit, admission stops for this step. The one
   exception: a request whose grammar is still compiling is stepped over (it keeps its place).
A sequence that can never fit (it needs more blocks than the whole pool) finishes with an error
instead of blocking the queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.core.sequence import SeqStatus, Sequence
from engine.kv.manager import KVCacheManager, PrefixMatch
from engine.kv.plan import KVPlan
from engine.kv.tiers import TieredCache


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    """Tokens computed for this sequence in this step (1 for a decode)."""
    start: int
    """Position of the first of them (tokens before it are already in the cache)."""

    @property
    def samples(self) -> bool:
        """This chunk reaches the sequence's last token: the step samples its next token."""
        return self.start + self.num_new_tokens == len(self.seq.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    plan: KVPlan = field(default_factory=KVPlan)
    """Copies to carry out before the forward pass."""
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)
    """Sequences that can never be served, with the reason."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, *, swap: TieredCache | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.swap = swap
        """Given in swap preemption mode: preempted sequences' KV goes to this CPU tier."""

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
        """Schedules running sequences, preempting the newest when blocks run out; returns the
        budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed, budget)
            while not self.kv.allocate(seq, num_new):
                victim = self.running[-1]
                if victim is seq:
                    break
                self._preempt(victim, out)
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
                budget -= num_new
                i += 1
                continue
            # The pool cannot hold even this sequence alone.
            if len(self.running) == 1 and not self._can_grow_alone(seq, num_new):
                self.running.remove(seq)
                self.kv.free(seq)
                out.failed.append((seq, self._too_big_message(seq)))
            else:
                self._preempt(seq, out)
            break
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admits waiting sequences in order, each with its longest cached prefix."""
        # Requests whose grammar is still compiling are set aside and put back in order.
        not_ready: list[Sequence] = []
        limit = self.config.max_num_partial_prefills
        prefilling = sum(1 for item in out.scheduled if item.start < item.seq.num_prompt_tokens)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if limit and prefilling >= limit:
                break
            seq = self.waiting[0]
            if seq.request.waiting_for_grammar:
                not_ready.append(self.waiting.popleft())
                continue
            if not self._can_ever_fit(seq):
                self.waiting.popleft()
                out.failed.append((seq, self._too_big_message(seq)))
                continue
            match = self.kv.match_prefix(seq) if seq.num_computed_tokens == 0 else None
            cached = match.num_tokens if match else 0
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens - cached, budget)
            if not self.kv.allocate(seq, num_new, match):
                if not self.running and not out.scheduled:
                    # Nothing else holds blocks: only cached free blocks stand in the way,
                    # and allocate already counts those as free. The sequence alone is too big.
                    self.waiting.popleft()
                    out.failed.append((seq, self._too_big_message(seq)))
                    continue
                break
            self.waiting.popleft()
            if self.swap is not None and match is not None:
                # A swapped-out sequence: its partial tail comes back from the CPU tier too.
                block_ids = self.kv.block_ids(seq.seq_id)
                num_new -= self.swap.resume(seq, match.num_blocks, num_new, block_ids, self.kv.plan)
            if seq.index == 0 and seq.num_preemptions == 0:
                self._record_hit(seq, match)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
            budget -= num_new
            prefilling += 1
        self.waiting.extendleft(reversed(not_ready))

    def _record_hit(self, seq: Sequence, match: PrefixMatch | None) -> None:
        if match is None:
            match = PrefixMatch(block_size=self.kv.block_size)
        self.kv.record_admission(len(seq.token_ids), match)
        by_tier = match.tokens_by_tier()
        ct = seq.request.cached_tokens
        ct.device, ct.cpu, ct.disk = by_tier["device"], by_tier["cpu"], by_tier["disk"]

    def _can_grow_alone(self, seq: Sequence, num_new: int) -> bool:
        need = -(-(seq.num_computed_tokens + num_new) // self.kv.block_size)
        return need <= self.kv.num_blocks

    def _too_big_message(self, seq: Sequence) -> str:
        cap = self.kv.num_blocks * self.kv.block_size
        return (
            f"the request needs {len(seq.token_ids)} tokens of KV cache but the pool holds "
            f"{cap}; shorten the prompt or max_tokens, or give the engine more KV blocks"
        )

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Frees the blocks and requeues the sequence at the front of the waiting queue.

        Recompute (default): its cached blocks stay findable, so it comes back through the prefix
        cache. Swap: its computed blocks are first spilled to the CPU tier and held there until it
        comes back (the partial tail too); when the CPU tier is full this falls back to recompute.
        """
        self.running.remove(seq)
        if self.swap is not None:
            self.swap.swap_out(seq, self.kv.block_ids(seq.seq_id), self.kv.plan)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _finish(self, out: SchedulerOutput) -> SchedulerOutput:
        if self.swap is not None:
            for seq, _ in out.failed:
                self.swap.drop_swap(seq.seq_id)
        out.plan = self.kv.take_plan()
        return out
