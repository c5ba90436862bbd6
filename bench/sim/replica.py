"""A simulated replica: engine/core/scheduler.py's step rule over an LRU prefix cache of block hashes.

Each step: running sequences, oldest first, get one decode token or their next prefill chunk
while the token budget lasts; then waiting requests are admitted first come, first served, each
with its longest cached prefix (device blocks free, CPU-tier blocks at `swap_block_s` each, moved
back to the device). Blocks a step completes enter the device LRU; a block pushed out of it spills
to the CPU tier's LRU, and out of that it is gone. Simplification: blocks of running sequences
are not pinned (the pools are sized so that the working set fits).

With an event buffer (`events`), every change of what a tier holds is reported as the engine's
KV events report it (engine/kv/events.py): `BlockStored(device)` when a block enters the device
LRU (computed or swapped in), `BlockRemoved(device)` + `BlockStored(cpu)` when it spills,
`BlockRemoved(cpu)` when it leaves the CPU tier (dropped, or moved back to the device).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.sim.profile import CostModel
from engine.core.step_rates import StepRates
from engine.kv.events import KVEventBuffer
from engine.kv.hashing import BlockHash


@dataclass(slots=True)
class SimSeq:
    request_id: int
    prompt_len: int
    output_len: int
    prompt_hashes: list[BlockHash]
    full_hashes: list[BlockHash]
    """Blocks of prompt + output, cached when the request finishes."""
    arrival: float
    computed: int = 0
    generated: int = 0
    cached_tokens: int = 0
    queued_hit: int = 0
    """While waiting: prompt tokens its device-tier prefix covered when it arrived."""

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prompt_len


@dataclass(slots=True)
class _Step:
    prefill: list[tuple[SimSeq, int]] = field(default_factory=list)
    decode: list[SimSeq] = field(default_factory=list)
    swap_blocks: int = 0


class SimReplica:
    def __init__(
        self,
        replica_id: str,
        model: CostModel,
        on_first_token: Callable[[SimSeq, float], None],
        on_finish: Callable[[SimSeq, float], None],
        events: KVEventBuffer | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.events = events
        self.m = model
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.device: OrderedDict[BlockHash, None] = OrderedDict()
        self.cpu: OrderedDict[BlockHash, None] = OrderedDict()
        self.rates = StepRates()
        self.busy = False
        self._on_first_token = on_first_token
        self._on_finish = on_finish
        self.busy_s = 0.0
        self.queued_token_s = 0.0
        """Integral of `queued_prefill_tokens()` over time (token-seconds)."""
        self._queued = 0
        self._queued_at = 0.0

    # What GetLoad publishes.

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute, a waiting request's device-cached prefix excluded
        (as the engine counts them, engine/core/engine_core.py `get_stats`)."""
        return sum(s.prompt_len - max(s.computed, s.queued_hit) for s in self.waiting) + sum(
            s.prompt_len - s.computed for s in self.running if s.in_prefill
        )

    def _requeue(self, now: float) -> None:
        """Closes the integral up to `now` at the old queue and takes the new one."""
        self.queued_token_s += self._queued * (now - self._queued_at)
        self._queued_at = now
        self._queued = self.queued_prefill_tokens()

    def decoding(self) -> int:
        return sum(1 for s in self.running if not s.in_prefill)

    def active_tokens(self) -> int:
        return sum(s.computed + s.generated for s in self.running)

    def kv_usage(self) -> float:
        used = sum(s.prompt_len + s.generated for s in self.running) / self.m.block_size
        return min(1.0, used / self.m.device_blocks)

    # Cache.

    def _insert(self, hashes: list[BlockHash]) -> None:
        ev = self.events
        for h in hashes:
            if h in self.device:
                self.device.move_to_end(h)
                continue
            self.device[h] = None
            if ev is not None:
                ev.stored([h], None, [], "device")
            if h in self.cpu:
                del self.cpu[h]
                self._removed(h, "cpu")
        while len(self.device) > self.m.device_blocks:
            h, _ = self.device.popitem(last=False)
            self._removed(h, "device")
            if self.m.cpu_blocks > 0:
                self.cpu[h] = None
                if ev is not None:
                    ev.stored_one(h, "cpu")
                while len(self.cpu) > self.m.cpu_blocks:
                    dropped, _ = self.cpu.popitem(last=False)
                    self._removed(dropped, "cpu")

    def _removed(self, h: BlockHash, tier: str) -> None:
        if self.events is not None:
            self.events.removed(h, tier)

    def _match(self, seq: SimSeq) -> tuple[int, int]:
        """Leading prompt blocks found on the device, then in the CPU tier after them."""
        dev = 0
        for h in seq.prompt_hashes:
            if h not in self.device:
                break
            dev += 1
        cpu = 0
        for h in seq.prompt_hashes[dev:]:
            if h not in self.cpu:
                break
            cpu += 1
        return dev, cpu

    # Steps.

    def add(self, seq: SimSeq, now: float) -> None:
        dev = 0
        for h in seq.prompt_hashes:
            if h not in self.device:
                break
            dev += 1
        seq.queued_hit = min(dev * self.m.block_size, seq.prompt_len - 1)
        self.waiting.append(seq)
        self._requeue(now)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def plan(self, now: float) -> tuple[_Step, float]:
        """The next step, planned at `now`, and its duration."""
        m = self.m
        budget = m.step_tokens
        step = _Step()
        for seq in self.running:
            if budget <= 0:
                break
            if seq.in_prefill:
                n = min(seq.prompt_len - seq.computed, budget)
                step.prefill.append((seq, n))
                budget -= n
            else:
                step.decode.append(seq)
                budget -= 1
        while self.waiting and budget > 0 and len(self.running) < m.max_num_seqs:
            seq = self.waiting.popleft()
            dev, cpu = self._match(seq)
            hit = min((dev + cpu) * m.block_size, seq.prompt_len - 1)
            seq.cached_tokens = hit
            step.swap_blocks += cpu
            for h in seq.prompt_hashes[:dev]:
                self.device.move_to_end(h)
            self._insert(seq.prompt_hashes[dev : dev + cpu])
            seq.computed = hit
            n = min(seq.prompt_len - seq.computed, budget)
            step.prefill.append((seq, n))
            budget -= n
            self.running.append(seq)
        prefill_tokens = sum(n for _, n in step.prefill)
        # attention pairs of each chunk: n new tokens over `computed` earlier ones and each other
        pairs = sum(n * seq.computed + n * n / 2 for seq, n in step.prefill)
        context = sum(s.prompt_len + s.generated for s in step.decode)
        dt = m.step_s(prefill_tokens, pairs, len(step.decode), context)
        dt += step.swap_blocks * m.swap_block_s
        self._requeue(now)
        return step, dt

    def finish_step(self, step: _Step, dt: float, now: float) -> None:
        """Applies a step planned `dt` seconds before `now`."""
        self.busy_s += dt
        prefill_tokens = sum(n for _, n in step.prefill)
        self.rates.observe(prefill_tokens, len(step.decode), dt, now)
        done: list[SimSeq] = []
        for seq, n in step.prefill:
            seq.computed += n
            if not seq.in_prefill:
                self._insert(seq.prompt_hashes)
                seq.generated = 1
                self._on_first_token(seq, now)
                if seq.generated >= seq.output_len:
                    done.append(seq)
        for seq in step.decode:
            seq.generated += 1
            if seq.generated >= seq.output_len:
                done.append(seq)
        for seq in done:
            self.running.remove(seq)
            self._insert(seq.full_hashes)
        self._requeue(now)
        for seq in done:
            self._on_finish(seq, now)
