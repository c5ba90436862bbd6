"""The engine's load and cache figures (`EngineCore.get_stats`), read without changing anything.

What a replica publishes (GetLoad, the router's polls, metrics). `queued_prefill_tokens` is the
work ahead of a new prompt: what running prefills have left, plus each waiting request's tokens
less the leading full blocks the device tier holds for it now (what its admission would hit);
lower tiers are not consulted, since a lookup there holds a reference until the next step.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.step_rates import StepRates
from engine.kv.manager import KVCacheManager
from engine.kv.tiers import TieredCache
from engine.stats import EngineStats, TierStats


class StatsSource(Protocol):
    """What the figures are read from (the EngineCore)."""

    config: EngineConfig
    kv: KVCacheManager
    tiers: TieredCache | None
    block_bytes: int
    scheduler: Scheduler
    step_rates: StepRates
    grammars: Any

    @property
    def offload(self) -> Any: ...


def uncached_waiting_tokens(kv: KVCacheManager, seq: Sequence) -> int:
    """A waiting sequence's tokens still to compute, less its device-cached leading blocks."""
    todo = seq.num_uncomputed
    if seq.num_computed_tokens or not kv.enable_caching:
        return todo
    bs = kv.block_size
    hit = 0
    for h in seq.block_hashes[: (len(seq.token_ids) - 1) // bs]:
        if kv.pool.lookup(h) is None:
            break
        hit += bs
    return todo - hit


def engine_stats(core: StatsSource) -> EngineStats:
    kv = core.kv
    in_use = kv.pool.num_used
    c = kv.counters
    tiers = [
        TierStats(
            name="device",
            num_blocks=kv.num_blocks,
            used_blocks=in_use,
            cached_blocks=len(kv.pool.cached),
            pinned_blocks=len(kv.pins),
            queries=c.device_queries,
            hits=c.device_hits,
            evictions=kv.pool.num_evictions,
        )
    ]
    if core.tiers is not None:
        core.tiers.add_stats(tiers, core.block_bytes)
    sched = core.scheduler
    running = sched.running
    queued = sum(uncached_waiting_tokens(kv, s) for s in sched.waiting) + sum(
        s.num_uncomputed for s in running if s.num_computed_tokens < s.num_prompt_tokens
    )
    return EngineStats(
        queued_prefill_tokens=queued,
        num_decoding=sum(1 for s in running if s.num_computed_tokens >= s.num_prompt_tokens),
        active_tokens=sum(s.num_computed_tokens for s in running),
        prefill_tokens_per_s=core.step_rates.prefill_tokens_per_s,
        decode_seq_s=core.step_rates.decode_seq_s,
        step_tokens=core.config.scheduler.max_num_batched_tokens,
        utilisation=core.step_rates.utilisation(time.monotonic()),
        busy_seconds=core.step_rates.total_busy_s,
        num_steps=core.step_rates.total_steps,
        num_running=len(running),
        num_waiting=len(sched.waiting),
        num_preemptions=sched.num_preemptions,
        kv_usage=in_use / kv.num_blocks,
        prefix_queries=c.device_queries,
        prefix_hits=c.prefix_hits,
        free_device_blocks=kv.num_free_blocks,
        tiers=tiers,
        grammar_cache=core.grammars.stats(),
        buffers=core.offload.buffers() if core.offload is not None else [],
        spec=None if sched.proposer is None else copy.deepcopy(sched.proposer.stats),
    )
