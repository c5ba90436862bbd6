"""The cost policy (the default): send a request where its time to first token is lowest.

For every healthy, not overloaded replica the router estimates

    ttft_s = (queued + uncached) / prefill_rate + decoding * decode_seq_s * steps
             + active_weight * active_tokens / prefill_rate

- `queued`: prefill tokens already waiting there: the larger of what the replica last published
  and what this router sent it that has not produced a first token yet (exact, no poll lag);
- `uncached`: this prompt's tokens minus the credit for the blocks the replica holds of it:
  1.0 per block on the device, 0.75 in the CPU tier, 0.25 on disk (the cost of bringing a block
  back relative to recomputing it; NVIDIA Dynamo's KV router uses the same credits), 0.5 in
  the remote tier shared by every replica (what its records hold counts for every replica: a
  session whose replica is gone goes where it is cheapest, its history a remote hit anywhere);
- `prefill_rate`: the replica's measured prefill tokens per second;
- the decode term: the engine schedules running sequences first, so every step that carries a
  piece of this prefill also carries one token of each of the `decoding` sequences; the prefill
  spans `steps = ceil((queued + uncached) / step_tokens)` steps of `decode_seq_s` per sequence;
- `active_tokens`: KV tokens of the replica's running sequences, a balance term (see
  `CostWeights.active_weight`).

Among the replicas under the load bound (`CostWeights.load_bound`: outstanding requests and
recent utilisation at most `load_bound` x the mean, as in consistent hashing with bounded loads;
default 1.0, i.e. new sessions go to replicas no busier than average) and the session's own
replica, the least score wins: the estimate plus the prefill time this prompt adds there,
weighted by `recompute_weight` (the wait it imposes on later arrivals) + `packing_weight` x the
requests there still waiting for a first token (which share its prefill step). Session affinity
and prefix overlap act only through `uncached`: a session's replica wins because it holds the
history, not by rule, so a hot replica loses its sessions once its queue costs more than
recomputing them elsewhere, counted for this request and (weighted) for the ones after it. The
session's last replica gets a bounded bonus (`stickiness_frac` of its estimate, at most
`stickiness_s`) so near-ties do not make a session flap. Ties go to the rendezvous rank of the
key, so routers with the same view agree. Optionally (`CostWeights.prefix_bound`) a replica
a little over the bound still wins when its estimate is clearly the lowest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service.affinity.prefix import TierBlocks

TIERS = ("device", "cpu", "disk", "remote")


@dataclass(frozen=True, slots=True)
class CostWeights:
    device_credit: float = 1.0
    """Share of a block's prefill saved when the replica holds it on the device."""
    cpu_credit: float = 0.75
    """... in its pinned CPU tier (swap-in instead of recompute)."""
    disk_credit: float = 0.25
    """... on its disk tier."""
    remote_credit: float = 0.5
    """... in the remote tier shared by every replica (`deja bench tiers` measures the load
    against a recompute)."""
    stickiness_frac: float = 0.2
    """The session's last replica's estimate is lowered by this share of itself ..."""
    stickiness_s: float = 0.05
    """... but by at most this many seconds."""
    default_prefill_tokens_per_s: float = 2000.0
    """For a replica that has not published a prefill rate yet."""
    default_step_tokens: int = 2048
    """For a replica that has not published its step token budget."""
    load_bound: float = 1.0
    """Bounded loads: only replicas whose outstanding requests, with this one, stay within
    `load_bound` x the mean (rounded up) are candidates, and the session's own replica; 0 turns
    the bound off. This, not the estimate, keeps a cached shared prefix (a system prompt) from
    pulling every new session onto the replica that computed it first."""
    prefix_bound: float = 0.0
    """A replica over `load_bound` but within `prefix_bound` x the mean (the same two caps) is
    still chosen when its estimate is below `prefix_gain` x the best one under `load_bound`: a
    large cached prefix outweighs a small excess load. 0: off (the default: on the chat
    workload it draws new sessions back to the replicas holding a system prompt, see
    docs/routing.md)."""
    prefix_gain: float = 0.5
    """See `prefix_bound`."""
    holder_share: float = 0.5
    """A replica whose cached blocks cover at least this share of the prompt is exempt from
    the load bound, as the session's own replica is: leaving it means recomputing what it
    holds, which the estimate weighs against its queue. Only while such holders are at most
    half of the pool, and only for a prefix whose share of the router's recent traffic fits
    one replica's share (service/router/popularity.py): a system prompt that many sessions
    start with must spread whoever computed it first (without that condition, on the chat
    workload the exemption piled new sessions onto the first holders of the system prompts).
    0: off."""
    holder_bound: float = 1.5
    """The exemption of `holder_share` holds up to this x the mean load (the load bound's two
    caps); 0: no cap."""
    recompute_weight: float = 2.0
    """The choice minimises the estimate plus this x the seconds of prefill the request adds
    there (`uncached / prefill_rate`): work a replica takes on is work the requests after it
    wait behind, so recomputing a history elsewhere costs the cluster more than this request's
    own time to first token. In a single-server queue at utilisation u, a second of work added
    delays the arrivals after it by u / (1 - u) seconds in all: 2 at the two thirds of capacity
    the router is sized for. 0: this request's estimate alone. The estimate reported stays the
    TTFT. (On the simulated chat workload, over seeds 0-4, the busiest replica queued 1.13-1.25x
    the mean with 2.0 against 1.19-1.30x with 1.0, hits and p50 unchanged.)"""
    packing_weight: float = 1.0
    """... plus this x the same prefill time per request this router sent there that has no first
    token yet: the engine packs waiting prompts into one step, and where a step's time grows
    with its tokens (a CPU) each of them waits for this prompt too. It splits a group of turns
    that arrive together at their sessions' replica (closed loops make such groups). 0 for an
    engine whose steps cost the same with one prompt or several."""
    active_weight: float = 0.0
    """Seconds of estimate per second it would take to prefill the KV tokens of the replica's
    running sequences (Dynamo counts active decode blocks like prefill blocks, weight 1): the
    load a request does not wait for but will share its steps with, and which future turns of
    the sessions already there will add to. It keeps cached prefixes from pulling every new
    session onto the replica that computed them first."""

    def __post_init__(self) -> None:
        for name in (
            "device_credit",
            "cpu_credit",
            "disk_credit",
            "remote_credit",
            "stickiness_frac",
        ):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.load_bound != 0 and self.load_bound < 1:
            raise ValueError(f"load_bound must be 0 (off) or >= 1, got {self.load_bound}")
        if self.prefix_bound != 0 and self.prefix_bound < max(1.0, self.load_bound):
            raise ValueError(
                f"prefix_bound must be 0 (off) or >= load_bound, got {self.prefix_bound}"
            )
        if self.holder_bound != 0 and self.holder_bound < max(1.0, self.load_bound):
            raise ValueError(
                f"holder_bound must be 0 (off) or >= load_bound, got {self.holder_bound}"
            )
        if not 0.0 <= self.holder_share <= 1.0:
            raise ValueError(f"holder_share must be in [0, 1], got {self.holder_share}")
        if not 0.0 < self.prefix_gain <= 1.0:
            raise ValueError(f"prefix_gain must be in (0, 1], got {self.prefix_gain}")
        if min(self.active_weight, self.recompute_weight, self.packing_weight) < 0:
            raise ValueError("active_weight, recompute_weight and packing_weight must be >= 0")
        if self.stickiness_s < 0 or self.default_prefill_tokens_per_s <= 0:
            raise ValueError("stickiness_s must be >= 0 and the default prefill rate > 0")
        if self.default_step_tokens < 1:
            raise ValueError("default_step_tokens must be >= 1")

    def credit(self, blocks: TierBlocks) -> float:
        """Block credit of (device, cpu, disk, remote) leading blocks held."""
        dev, cpu, disk, remote = blocks
        return (
            dev * self.device_credit
            + cpu * self.cpu_credit
            + disk * self.disk_credit
            + remote * self.remote_credit
        )


@dataclass(frozen=True, slots=True)
class ReplicaCost:
    """The estimate for one replica, kept for the route span and the simulator's reports."""

    replica_id: str
    ttft_s: float
    """Estimated time to first token, stickiness bonus included."""
    uncached_tokens: int
    """Prompt tokens it would compute (after tier credits)."""
    queued_tokens: int
    """Prefill tokens ahead of this prompt there."""
    score_s: float = 0.0
    """What the choice minimises: `ttft_s` plus (`recompute_weight` + `packing_weight` x pending
    requests) x this prompt's prefill time there."""


def estimate(
    *,
    replica_id: str,
    prompt_tokens: int,
    block_size: int,
    held: TierBlocks,
    queued_tokens: int,
    pending_requests: int = 0,
    decoding: int,
    active_tokens: int,
    prefill_tokens_per_s: float,
    decode_seq_s: float,
    step_tokens: int,
    sticky: bool,
    weights: CostWeights,
) -> ReplicaCost:
    """One replica's estimate (see the module docstring)."""
    credit_tokens = weights.credit(held) * block_size
    # NOTE: the engine always computes the prompt's last token, even on a full hit.
    uncached = max(1, prompt_tokens - int(credit_tokens)) if prompt_tokens > 0 else 0
    rate = (
        prefill_tokens_per_s if prefill_tokens_per_s > 0 else weights.default_prefill_tokens_per_s
    )
    work = max(0, queued_tokens) + uncached
    steps = max(1, math.ceil(work / max(1, step_tokens)))
    ttft = work / rate + max(0, decoding) * max(0.0, decode_seq_s) * steps
    ttft += weights.active_weight * max(0, active_tokens) / rate
    if sticky:
        ttft -= min(weights.stickiness_s, weights.stickiness_frac * ttft)
    # NOTE: the request's own work, charged again for those it delays: the ones after it, and
    # the ones it will share a prefill step with.
    behind = weights.recompute_weight + weights.packing_weight * max(0, pending_requests)
    score = ttft + behind * uncached / rate
    return ReplicaCost(replica_id, ttft, uncached, max(0, queued_tokens), score)


def held_blocks(
    replica_id: str,
    prefix_blocks: Mapping[str, int] | None,
    prefix_tiers: Mapping[str, TierBlocks] | None,
) -> TierBlocks:
    """(device, cpu, disk, remote) leading blocks a replica holds; tier-less records count as
    device."""
    if prefix_tiers is not None and replica_id in prefix_tiers:
        return prefix_tiers[replica_id]
    return ((prefix_blocks or {}).get(replica_id, 0), 0, 0, 0)


def within_bound(
    loads: Mapping[str, int], utilisation: Mapping[str, float], bound: float
) -> set[str]:
    """Replicas that may take a new session under bounded loads (all when `bound` is 0).

    Two caps, both `bound` x the mean: outstanding requests (`ceil(bound * (total + 1) / n)`,
    exact for this router's own streams, so a burst between polls spreads) and utilisation over
    the last ~120 s (plus 0.02, so idle replicas are never excluded), which counts the sessions a
    replica is home to while they are between turns. When no replica meets both, the request
    cap alone; at least one replica always meets that."""
    if bound <= 0 or not loads:
        return set(loads)
    cap = math.ceil(bound * (sum(loads.values()) + 1) / len(loads))
    by_count = {rid for rid, load in loads.items() if load + 1 <= cap}
    mean_u = sum(utilisation.get(rid, 0.0) for rid in loads) / len(loads)
    both = {rid for rid in by_count if utilisation.get(rid, 0.0) <= bound * mean_u + 0.02}
    return both or by_count


def cheapest(costs: Sequence[ReplicaCost], rank: Mapping[str, int]) -> ReplicaCost:
    """The least score; ties (within a microsecond) by rendezvous rank."""
    return min(costs, key=lambda c: (round(c.score_s, 6), rank[c.replica_id]))
