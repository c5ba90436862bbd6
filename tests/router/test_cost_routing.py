"""The cost policy: its estimate, and routers sharing one Redis (in process, fake replicas).

- Two routers on one Redis route the same sessions to the same replicas (turns alternate
  between the routers).
- After a replica restarts and its records are gone, its agent republishes the blocks the engine
  holds, and the sessions whose history it holds go back to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from engine.frontend.prompt import prompt_block_hashes
from service.affinity import AffinityConfig
from service.affinity.base import ReplicaInfo
from service.affinity.redis_store import RedisAffinityStore
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from service.replica.agent import ReplicaAgent
from service.router.config import RouterConfig
from service.router.cost import CostWeights, estimate
from service.router.policy import Candidate, OverloadGuard, RouteInputs, decide
from service.router.server import Router, serve_router
from tests.support.redis_proc import RedisProcess

from .fake_replica import BLOCK_SIZE, MODEL_ID, FakeReplica
from .test_router import generate, prompt

GUARD = OverloadGuard()


def _c(rid: str, **kw: object) -> Candidate:
    return Candidate(rid, prefill_tokens_per_s=1000.0, block_size=16, **kw)  # type: ignore[arg-type]


def test_estimate_credits_tiers_like_dynamo() -> None:
    w = CostWeights()
    base = dict(
        replica_id="r",
        prompt_tokens=1600,
        block_size=16,
        queued_tokens=0,
        decoding=0,
        active_tokens=0,
        prefill_tokens_per_s=1000.0,
        decode_seq_s=0.0,
        step_tokens=2048,
        sticky=False,
        weights=w,
    )
    assert estimate(held=(100, 0, 0, 0), **base).uncached_tokens == 1  # type: ignore[arg-type]
    assert estimate(held=(0, 100, 0, 0), **base).uncached_tokens == 400  # type: ignore[arg-type]
    assert estimate(held=(0, 0, 100, 0), **base).uncached_tokens == 1200  # type: ignore[arg-type]
    assert estimate(held=(0, 0, 0, 0), **base).ttft_s == pytest.approx(1.6)  # type: ignore[arg-type]


def test_cached_history_wins_until_its_queue_costs_more_than_recomputing() -> None:
    inputs = RouteInputs("s1", "r0", {"r0": 60}, prompt_tokens=1000)  # r0 holds 960 tokens
    idle = decide("cost", [_c("r0"), _c("r1")], inputs, GUARD)
    assert (idle.replica_id, idle.reason, idle.uncached_tokens) == ("r0", "cost", 40)
    # r0 has 500 tokens queued: 0.54 s there against 1.0 s recomputing on r1 (which the
    # default recompute_weight 2 charges 3.0 s: the 1.0 s its later arrivals wait, twice).
    busy = decide("cost", [_c("r0", queued_prefill_tokens=500), _c("r1")], inputs, GUARD)
    assert busy.replica_id == "r0"
    # 2,000 queued: 2.04 s there, still under 3.0 s.
    warm = decide("cost", [_c("r0", queued_prefill_tokens=2000), _c("r1")], inputs, GUARD)
    assert warm.replica_id == "r0"
    # 3,500 queued: 3.54 s there, the history moves.
    hot = decide("cost", [_c("r0", queued_prefill_tokens=3500), _c("r1")], inputs, GUARD)
    assert hot.replica_id == "r1"
    # The router's own unanswered sends count when the poll has not seen them yet.
    own = decide("cost", [_c("r0", pending_prefill_tokens=3500), _c("r1")], inputs, GUARD)
    assert own.replica_id == "r1"


def test_recompute_weight_charges_the_work_a_move_adds() -> None:
    # r0 holds 960 of 1,000 tokens and has 1,500 queued: 1.54 s there, 1.0 s recomputing on r1.
    inputs = RouteInputs("s1", "r0", {"r0": 60}, prompt_tokens=1000)
    cands = [_c("r0", queued_prefill_tokens=1500), _c("r1")]
    own_ttft = decide("cost", cands, inputs, GUARD, weights=CostWeights(recompute_weight=0))
    assert own_ttft.replica_id == "r1"
    # Weighted, the move costs r1's later arrivals the 1.0 s of prefill it adds: 1.0 + 1 x 1.0
    # = 2.0 > 1.53 at weight 1, and 3.0 at the default 2.
    weighted = decide("cost", cands, inputs, GUARD, weights=CostWeights(recompute_weight=1))
    # (the estimate reported is the TTFT, less the 0.05 s stickiness bonus)
    assert (weighted.replica_id, weighted.est_ttft_s) == ("r0", pytest.approx(1.49))
    # The weight only raises the bar: a queue that costs more than both still moves the session.
    cands = [_c("r0", queued_prefill_tokens=2500), _c("r1")]
    assert (
        decide("cost", cands, inputs, GUARD, weights=CostWeights(recompute_weight=1)).replica_id
        == "r1"
    )
    assert decide("cost", cands, inputs, GUARD).replica_id == "r0"  # 2.53 < 3.0
    cands = [_c("r0", queued_prefill_tokens=3500), _c("r1")]
    assert decide("cost", cands, inputs, GUARD).replica_id == "r1"
    with pytest.raises(ValueError):
        CostWeights(recompute_weight=-1)


def _group(inputs: RouteInputs, n: int, w: CostWeights | None = None) -> list[str]:
    """Where n requests like `inputs`, arriving together, go (this router's pending counts)."""
    placed: list[str] = []
    tokens, requests = {"r0": 0, "r1": 0}, {"r0": 0, "r1": 0}
    for _ in range(n):
        cands = [
            _c(r, pending_requests=requests[r], pending_prefill_tokens=tokens[r]) for r in tokens
        ]
        d = decide("cost", cands, inputs, GUARD, weights=w)
        placed.append(d.replica_id)
        tokens[d.replica_id] += d.uncached_tokens
        requests[d.replica_id] += 1
    return placed


def test_packing_weight_splits_a_group_of_turns_arriving_together() -> None:
    # Sessions whose histories live on r0 send their next turns at once. Every request still
    # waiting there for a first token shares the newcomer's prefill step, so the newcomer's
    # prefill counts once more per such request.
    light = RouteInputs("s1", "r0", {"r0": 60}, prompt_tokens=1000)  # 40 new tokens on r0
    assert _group(light, 4) == ["r0"] * 4  # recomputing 1,000 tokens costs far more
    heavy = RouteInputs("s1", "r0", {"r0": 40}, prompt_tokens=1000)  # 360 new tokens on r0
    # The fourth goes where it waits alone: 1.39 s there + (2 + 3 waiting) x 0.36 s = 3.19 s
    # against 1.0 s + 2 x 1.0 s on r1 (recompute_weight 2).
    assert _group(heavy, 4) == ["r0", "r0", "r0", "r1"]
    assert _group(heavy, 4, CostWeights(recompute_weight=1)) == ["r0", "r0", "r1", "r0"]
    # Without it the whole group queues on r0.
    assert _group(heavy, 4, CostWeights(packing_weight=0)) == ["r0"] * 4
    with pytest.raises(ValueError):
        CostWeights(packing_weight=-1)


def test_stickiness_is_bounded() -> None:
    w = CostWeights(stickiness_s=0.05, stickiness_frac=0.2)
    # Equal estimates: the session's replica wins the near-tie.
    inputs = RouteInputs("s", "r1", {}, prompt_tokens=100)
    assert decide("cost", [_c("r0"), _c("r1")], inputs, GUARD, weights=w).replica_id == "r1"
    # 0.1 s worse on r1 (100 more queued tokens): more than the 0.05 s bonus.
    worse = [_c("r0"), _c("r1", queued_prefill_tokens=100)]
    assert decide("cost", worse, inputs, GUARD, weights=w).replica_id == "r0"


def test_new_sessions_spread_by_rendezvous_when_all_equal() -> None:
    cands = [_c(f"r{i}") for i in range(4)]
    picks = {
        decide("cost", cands, RouteInputs(f"s{i}", prompt_tokens=64), GUARD).replica_id
        for i in range(40)
    }
    assert len(picks) == 4


def test_bounded_loads_spread_new_sessions_but_keep_histories() -> None:
    # r0 holds a shared system prompt (60 blocks) and has 4 requests out; the mean is 1.
    cands = [_c("r0", running=4), _c("r1"), _c("r2"), _c("r3")]
    new = decide("cost", cands, RouteInputs("new", None, {"r0": 60}, prompt_tokens=1000), GUARD)
    assert new.replica_id != "r0"  # cap: ceil(1.0 * 5 / 4) = 2 outstanding
    # A session whose history lives on r0 stays: leaving would recompute it.
    own = decide("cost", cands, RouteInputs("old", "r0", {"r0": 60}, prompt_tokens=1000), GUARD)
    assert own.replica_id == "r0"
    # Without the bound the shared prefix pulls the new session onto r0 as well.
    w = CostWeights(load_bound=0)
    inputs = RouteInputs("new", None, {"r0": 60}, prompt_tokens=1000)
    assert decide("cost", cands, inputs, GUARD, weights=w).replica_id == "r0"


def test_prefix_bound_lets_a_large_cached_prefix_outweigh_a_small_excess_load() -> None:
    # r0 holds 60 of the prompt's 62 blocks and has one request more than the others.
    inputs = RouteInputs("new", None, {"r0": 60}, prompt_tokens=1000)
    cands = [_c("r0", running=2), _c("r1", running=1), _c("r2", running=1), _c("r3", running=1)]
    # (the holder exemption, on by default, would take r0 too: off here to see the bounds)
    plain = CostWeights(holder_share=0)
    assert decide("cost", cands, inputs, GUARD, weights=plain).replica_id != "r0"  # cap 2
    w = CostWeights(prefix_bound=1.5, holder_share=0)  # cap ceil(1.5 * 6 / 4) = 3: r0 is in
    assert decide("cost", cands, inputs, GUARD, weights=w).replica_id == "r0"
    assert decide("cost", cands, inputs, GUARD).replica_id == "r0"  # the default: a holder
    # Too far over even the wider bound: the prefix does not pull.
    cands[0] = _c("r0", running=4)
    assert decide("cost", cands, inputs, GUARD, weights=w).replica_id != "r0"
    with pytest.raises(ValueError):
        CostWeights(load_bound=1.5, prefix_bound=1.2)


def test_holder_share_exempts_a_replica_holding_most_of_the_prompt_from_the_bound() -> None:
    # r0 holds 60 of the prompt's 62 blocks but has 4 requests out: over the bound (cap 2).
    inputs = RouteInputs("new", None, {"r0": 60}, prompt_tokens=1000)
    cands = [_c("r0", running=4), _c("r1"), _c("r2"), _c("r3")]
    # the default caps the exemption at 1.5x the mean (ceil(1.5 * 5 / 4) = 2): r0 is over it
    assert decide("cost", cands, inputs, GUARD).replica_id != "r0"
    assert (
        decide("cost", cands, inputs, GUARD, weights=CostWeights(holder_share=0)).replica_id != "r0"
    )
    w = CostWeights(holder_share=0.5, holder_bound=0)
    assert decide("cost", cands, inputs, GUARD, weights=w).replica_id == "r0"
    # A prefix under the share is no reason to leave the bound.
    few = RouteInputs("new", None, {"r0": 20}, prompt_tokens=1000)
    assert decide("cost", cands, few, GUARD, weights=w).replica_id != "r0"
    # Held by more than half of the pool (a hot system prompt): the replicas within the bound
    # hold it too, so the bound stands.
    wide = RouteInputs("new", None, {"r0": 60, "r1": 60, "r2": 60}, prompt_tokens=1000)
    assert decide("cost", cands, wide, GUARD, weights=w).replica_id in ("r1", "r2")
    # --holder-bound caps the exemption at its multiple of the mean: with the others at 1 out,
    # r0 at 3 is within ceil(2.0 * 7 / 4) = 4 (though over the bound's 2), at 5 it is not.
    capped = CostWeights(holder_share=0.5, holder_bound=2.0)
    cands = [_c("r0", running=3), _c("r1", running=1), _c("r2", running=1), _c("r3", running=1)]
    assert decide("cost", cands, inputs, GUARD).replica_id != "r0"
    assert decide("cost", cands, inputs, GUARD, weights=capped).replica_id == "r0"
    cands[0] = _c("r0", running=5)
    assert decide("cost", cands, inputs, GUARD, weights=capped).replica_id != "r0"
    with pytest.raises(ValueError):
        CostWeights(holder_share=1.5)
    with pytest.raises(ValueError):
        CostWeights(holder_bound=0.5)


def test_holders_of_a_prefix_too_popular_for_one_replica_stay_bounded() -> None:
    """The exemption holds for a prefix whose share of recent traffic fits one replica's share
    (share x replicas <= 1), judged at the block that makes a holder (half the prompt)."""
    cands = [_c("r0", running=4), _c("r1"), _c("r2"), _c("r3")]
    w = CostWeights(holder_share=0.5, holder_bound=0.0)

    def routed(shares: tuple[tuple[int, float], ...] | None) -> str:
        inputs = RouteInputs("new", None, {"r0": 60}, prompt_tokens=1000, prefix_shares=shares)
        return decide("cost", cands, inputs, GUARD, weights=w).replica_id

    assert routed(None) == "r0"  # not tracked: the exemption as before
    # a customer's document: 1 request in 10 starts with blocks 0..31
    assert routed(((0, 0.9), (1, 0.5), (3, 0.2), (7, 0.1), (15, 0.1), (31, 0.1))) == "r0"
    # a system prompt 1 request in 2 starts with: the four replicas must share it
    assert routed(((0, 0.9), (1, 0.5), (3, 0.5), (7, 0.5), (15, 0.5), (31, 0.5))) != "r0"
    # judged at block 31 (500 tokens of 16): a popular first block alone does not count
    assert routed(((0, 1.0), (31, 0.25))) == "r0"
    assert routed(((0, 1.0), (31, 0.26))) != "r0"


# -- routers on one Redis -------------------------------------------------------------------------


async def _routers(
    redis: RedisProcess, replicas: list[FakeReplica], n: int
) -> AsyncIterator[list[Router]]:
    routers = []
    for i in range(n):
        cfg = RouterConfig(
            port=0,
            router_id=f"router{i}",
            replicas=tuple(r.address for r in replicas),
            poll_interval_s=0.1,
            poll_timeout_s=1.0,
            discover=False,
            affinity=AffinityConfig(redis_url=redis.url),
        )
        store = RedisAffinityStore(redis.url, op_timeout_s=1.0)
        routers.append(await serve_router(cfg, store=store))
    try:
        yield routers
    finally:
        for r in routers:
            await r.shutdown(0)


async def _fakes(n: int) -> list[FakeReplica]:
    replicas = [FakeReplica(f"r{i}") for i in range(n)]
    for r in replicas:
        await r.start()
    return replicas


async def _until_healthy(routers: list[Router], n: int) -> None:
    for _ in range(100):
        if all(len(r.pool.healthy()) == n for r in routers):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("replicas never became healthy")


async def test_two_routers_on_one_redis_agree(redis_proc: RedisProcess) -> None:
    replicas = await _fakes(3)
    try:
        async for routers in _routers(redis_proc, replicas, 2):
            await _until_healthy(routers, 3)
            channels = [grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") for r in routers]
            stubs = [pb_grpc.InferenceStub(c) for c in channels]
            homes: dict[int, list[str]] = {}
            for turn in range(4):
                for s in range(8):
                    stub = stubs[(s + turn) % 2]  # turns alternate between the routers
                    final = await generate(stub, prompt(s, turn), f"two-{s}")
                    assert final.route.reason == "cost"
                    homes.setdefault(s, []).append(final.replica_id)
            for c in channels:
                await c.close()
            for s, reps in homes.items():
                assert len(set(reps)) == 1, (s, reps)
            assert len({reps[0] for reps in homes.values()}) >= 2, "sessions should spread"
    finally:
        for r in replicas:
            await r.stop()


async def test_restarted_replica_gets_its_sessions_back_after_republishing(
    redis_proc: RedisProcess,
) -> None:
    replicas = await _fakes(3)
    try:
        async for routers in _routers(redis_proc, replicas, 1):
            router = routers[0]
            await _until_healthy(routers, 3)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
            stub = pb_grpc.InferenceStub(channel)
            homes = {
                s: (await generate(stub, prompt(s, 0), f"re-{s}")).replica_id for s in range(9)
            }
            victim = next(rid for rid in ("r0", "r1", "r2") if list(homes.values()).count(rid) >= 2)
            mine = [s for s, rid in homes.items() if rid == victim]
            # The victim restarts; its records are gone (expired while it was down).
            fake = next(r for r in replicas if r.replica_id == victim)
            port = fake.port
            await fake.stop()
            chains = {
                s: prompt_block_hashes(prompt(s, 0), BLOCK_SIZE, MODEL_ID, None) for s in mine
            }
            for chain in chains.values():
                await router.store.remove_prefix(victim, chain)
                assert victim not in await router.store.longest_prefix(chain)
            await fake.start(port)
            await _until_healthy(routers, 3)
            # Its engine still holds what it computed (disk tier); the agent republishes that.
            held = [h for chain in chains.values() for h in chain]

            async def cached(limit: int, held: list[bytes] = held) -> list[bytes]:
                return held[:limit]

            agent_store = RedisAffinityStore(redis_proc.url, op_timeout_s=1.0)
            agent = ReplicaAgent(
                agent_store,
                ReplicaInfo(victim, fake.address, MODEL_ID, BLOCK_SIZE),
                lambda: None,  # type: ignore[arg-type,return-value]
                AffinityConfig(redis_url=redis_proc.url),
                capacity_blocks=1024,
                cached_hashes=cached,
            )
            assert await agent.republish() == len(held)
            for s in mine:
                # A fresh session id: only the republished prefix can bring it back.
                final = await generate(stub, prompt(s, 1), f"new-{s}")
                assert (final.replica_id, final.route.reason) == (victim, "cost")
                final = await generate(stub, prompt(s, 2), f"re-{s}")
                assert final.replica_id == victim
            await agent_store.close()
            await channel.close()
    finally:
        for r in replicas:
            await r.stop()


def test_the_shared_tier_counts_for_every_replica() -> None:
    """The remote tier's records (REMOTE_HOLDER) extend every replica's own run: a replica that
    holds 2 blocks gets the remote run's other 4; one that holds none gets all 6; one past the
    remote run keeps its own; nothing is invented without records."""
    from service.affinity.prefix import REMOTE_HOLDER, with_shared_tier

    held = {"a": (2, 0, 0, 0), "c": (7, 0, 0, 0), REMOTE_HOLDER: (0, 0, 0, 6), "gone": (9, 0, 0, 0)}
    out = with_shared_tier(held, ["a", "b", "c"])
    assert out == {"a": (2, 0, 0, 4), "b": (0, 0, 0, 6), "c": (7, 0, 0, 0)}
    assert with_shared_tier({"a": (2, 0, 0, 0)}, ["a", "b"]) == {"a": (2, 0, 0, 0)}
    w = CostWeights()
    assert w.credit(out["b"]) == 6 * w.remote_credit
    assert w.credit(out["a"]) == 2 * w.device_credit + 4 * w.remote_credit
