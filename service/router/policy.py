"""Routing decisions: which replica serves a request, and why. Pure functions, no I/O.

The affinity policy, in order:
1. Store unreachable: rendezvous hashing of the routing key (session id, else request id) over
   the healthy replicas; reason "fallback". Every router ranks replicas the same way, so a
   session stays put for as long as its replica does.
2. The session's replica, if it is healthy and not overloaded; reason "session".
3. The replica holding the longest prefix of the prompt (ties: least loaded), if it is not
   overloaded and not more than `max_imbalance` busier than the least loaded one; "prefix".
4. The least loaded replica (ties: rendezvous rank of the key, which spreads new sessions and
   matches step 1 after an outage); reason "load".
Overloaded replicas are skipped at every step unless all are overloaded. round_robin cycles
through the healthy replicas; prefix_only skips step 2.

The cost policy (the default, service/router/cost.py) replaces steps 2-4 with one rule: the
replica with the least estimated time to first token, where the session and the prefix count
only through the prompt tokens the replica would not have to compute.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service.affinity.prefix import TierBlocks
from service.affinity.rendezvous import rendezvous_order
from service.router.cost import (
    CostWeights,
    ReplicaCost,
    cheapest,
    estimate,
    held_blocks,
    within_bound,
)
from service.router.popularity import share_at

POLICIES = ("cost", "affinity", "round_robin", "prefix_only")
REASONS = ("session", "prefix", "load", "fallback", "round_robin", "cost")


class NoReplicaError(RuntimeError):
    """No healthy replica to route to."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A healthy replica as the router sees it right now."""

    replica_id: str
    running: int = 0
    """Engine running requests, as of the last load poll."""
    waiting: int = 0
    """Engine queued requests, as of the last load poll."""
    kv_usage: float = 0.0
    """Share of device KV blocks in use, as of the last load poll."""
    inflight: int = 0
    """Streams this router has open to the replica (exact, no polling delay)."""
    queued_prefill_tokens: int = 0
    """Prompt tokens the engine has still to prefill, as of the last load poll."""
    pending_prefill_tokens: int = 0
    """Uncached prompt tokens this router sent there still waiting for a first token (exact)."""
    pending_requests: int = 0
    """Requests this router sent there still waiting for a first token (exact)."""
    decoding: int = 0
    """Running sequences past their prefill, as of the last load poll."""
    active_tokens: int = 0
    """KV tokens held by running sequences, as of the last load poll."""
    prefill_tokens_per_s: float = 0.0
    """Measured prefill rate (0: not published yet)."""
    decode_seq_s: float = 0.0
    """Measured step time per decoding sequence: what one decode adds to each step."""
    step_tokens: int = 0
    """The engine's token budget per step (0: not published)."""
    utilisation: float = 0.0
    """Share of the last ~120 s the engine spent in steps, as of the last load poll."""
    block_size: int = 16

    @property
    def load(self) -> int:
        return max(self.inflight, self.running + self.waiting)


@dataclass(frozen=True, slots=True)
class OverloadGuard:
    max_waiting: int = 8
    """A replica with more requests queued in its engine is overloaded."""
    max_kv_usage: float = 0.95
    """A replica with a larger share of its KV blocks in use is overloaded."""
    max_inflight: int = 0
    """A replica with more streams open from this router is overloaded; 0: no limit."""
    max_imbalance: int = 2
    """A prefix match is ignored if its replica's load exceeds the least loaded one's by more."""

    def __post_init__(self) -> None:
        if self.max_waiting < 0 or self.max_inflight < 0 or self.max_imbalance < 0:
            raise ValueError("overload thresholds must be >= 0")
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError(f"max_kv_usage must be in (0, 1], got {self.max_kv_usage}")

    def overloaded(self, c: Candidate) -> bool:
        return (
            c.waiting > self.max_waiting
            or c.kv_usage > self.max_kv_usage
            or (self.max_inflight > 0 and c.inflight > self.max_inflight)
        )


@dataclass(frozen=True, slots=True)
class RouteInputs:
    key: str
    """Session id, else request id: the rendezvous and tie-break key."""
    session_replica: str | None = None
    """The session's replica according to the store."""
    prefix_blocks: Mapping[str, int] | None = None
    """Replica id -> leading prompt blocks it holds (None: not looked up)."""
    store_ok: bool = True
    """False when the store could not be read; routing then falls back to rendezvous."""
    prompt_tokens: int = 0
    """The prompt's length in tokens (cost policy; 0: unknown)."""
    prefix_tiers: Mapping[str, TierBlocks] | None = None
    """Replica id -> leading blocks held on (device, cpu, disk, remote); None: prefix_blocks,
    all device."""
    prefix_shares: tuple[tuple[int, float], ...] | None = None
    """(block index, share of the router's recent requests whose prompts contain the prompt's
    blocks up to it) at a few depths (service/router/popularity.py); None: not tracked."""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica_id: str
    reason: str
    """One of REASONS."""
    prefix_blocks: int = 0
    """Leading prompt blocks the chosen replica was known to hold."""
    uncached_tokens: int = 0
    """Cost policy: prompt tokens the chosen replica is expected to compute."""
    est_ttft_s: float = 0.0
    """Cost policy: the chosen replica's estimate."""


def decide(
    policy: str,
    candidates: Sequence[Candidate],
    inputs: RouteInputs,
    guard: OverloadGuard,
    rr_index: int = 0,
    weights: CostWeights | None = None,
) -> RouteDecision:
    """Picks a replica among `candidates` (all healthy); raises NoReplicaError if there are none."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not candidates:
        raise NoReplicaError("no healthy replica")
    if policy == "round_robin":
        ordered = sorted(candidates, key=lambda c: c.replica_id)
        return RouteDecision(ordered[rr_index % len(ordered)].replica_id, "round_robin")

    pool = [c for c in candidates if not guard.overloaded(c)] or list(candidates)
    rank = {
        rid: i for i, rid in enumerate(rendezvous_order(inputs.key, [c.replica_id for c in pool]))
    }
    prefix = inputs.prefix_blocks or {}
    if not inputs.store_ok:
        # NOTE: affinity during an outage comes from the hash alone, so skip only replicas
        # that are overloaded, never merely busier.
        best = min(pool, key=lambda c: rank[c.replica_id])
        return RouteDecision(best.replica_id, "fallback", prefix.get(best.replica_id, 0))
    if policy == "cost":
        return _decide_cost(pool, inputs, rank, weights or CostWeights())
    session = inputs.session_replica if policy == "affinity" else None
    return _decide_affinity(candidates, pool, prefix, session, guard, rank)


def _decide_cost(
    pool: Sequence[Candidate], inputs: RouteInputs, rank: dict[str, int], w: CostWeights
) -> RouteDecision:
    """The least estimated TTFT among the replicas within the load bound (service/router/cost.py)."""
    prefix = inputs.prefix_blocks or {}
    loads = {c.replica_id: c.load for c in pool}
    utils = {c.replica_id: c.utilisation for c in pool}
    allowed = within_bound(loads, utils, w.load_bound)
    # NOTE: the session's own replica is exempt: leaving it means recomputing the history,
    # which the estimate weighs against its queue. The bound places new sessions.
    if inputs.session_replica in loads:
        allowed.add(inputs.session_replica)
    costs = {c.replica_id: _estimate(c, inputs, w) for c in pool}
    if w.holder_share > 0 and inputs.prompt_tokens > 0:
        # NOTE: like the session's replica, a replica holding most of the prompt is exempt
        # (the request is little new work there), while such holders are at most half of the
        # pool (a prefix most replicas hold is no reason to break the bound: replicas within
        # it hold it too), and only for a prefix whose share of the traffic fits one replica:
        # a popular one (4 system prompts over 16 replicas) must spread whoever computed it
        # first, and exempting its holders piles its sessions onto them (docs/routing.md).
        need = w.holder_share * inputs.prompt_tokens
        holders = {
            rid for rid, c in costs.items() if inputs.prompt_tokens - c.uncached_tokens >= need
        }
        if holders and inputs.prefix_shares is not None:
            depth = max(0, math.ceil(need / pool[0].block_size) - 1)
            share = share_at(inputs.prefix_shares, depth)
            if share is not None and share * len(costs) > 1.0:
                holders = set()
        if w.holder_bound > 0:
            holders &= within_bound(loads, utils, w.holder_bound)
        if 2 * len(holders) <= len(costs):
            allowed |= holders
    best_cost = cheapest([costs[r] for r in allowed], rank)
    if w.prefix_bound > 0 and w.load_bound > 0:
        # NOTE: a replica a little over the bound still wins when its estimate is clearly
        # the lowest (a large cached prefix): the bound keeps sessions from piling onto
        # whoever computed a prefix first, not a replica from using what it holds.
        wider = within_bound(loads, utils, w.prefix_bound) - allowed
        clear = [costs[r] for r in wider if costs[r].score_s < w.prefix_gain * best_cost.score_s]
        if clear:
            best_cost = cheapest(clear, rank)
    return RouteDecision(
        best_cost.replica_id,
        "cost",
        prefix.get(best_cost.replica_id, 0),
        best_cost.uncached_tokens,
        best_cost.ttft_s,
    )


def _estimate(c: Candidate, inputs: RouteInputs, w: CostWeights) -> ReplicaCost:
    """This request's estimated TTFT on candidate `c`."""
    return estimate(
        replica_id=c.replica_id,
        prompt_tokens=inputs.prompt_tokens,
        block_size=c.block_size,
        held=held_blocks(c.replica_id, inputs.prefix_blocks or {}, inputs.prefix_tiers),
        queued_tokens=max(c.queued_prefill_tokens, c.pending_prefill_tokens),
        pending_requests=c.pending_requests,
        decoding=c.decoding,
        active_tokens=c.active_tokens,
        prefill_tokens_per_s=c.prefill_tokens_per_s,
        decode_seq_s=c.decode_seq_s,
        step_tokens=c.step_tokens or w.default_step_tokens,
        sticky=c.replica_id == inputs.session_replica,
        weights=w,
    )


def _decide_affinity(
    candidates: Sequence[Candidate],
    pool: Sequence[Candidate],
    prefix: Mapping[str, int],
    session_replica: str | None,
    guard: OverloadGuard,
    rank: dict[str, int],
) -> RouteDecision:
    """The session's replica (affinity only) -> the longest prefix among the least loaded -> the
    least load."""
    if session_replica is not None:
        own = next((c for c in candidates if c.replica_id == session_replica), None)
        if own is not None and not guard.overloaded(own):
            return RouteDecision(own.replica_id, "session", prefix.get(own.replica_id, 0))
    min_load = min(c.load for c in pool)
    holders = [
        c
        for c in pool
        if prefix.get(c.replica_id, 0) > 0 and c.load <= min_load + guard.max_imbalance
    ]
    if holders:
        best = min(holders, key=lambda c: (-prefix[c.replica_id], c.load, rank[c.replica_id]))
        return RouteDecision(best.replica_id, "prefix", prefix[best.replica_id])
    best = min(pool, key=lambda c: (c.load, c.kv_usage, rank[c.replica_id]))
    return RouteDecision(best.replica_id, "load", prefix.get(best.replica_id, 0))
