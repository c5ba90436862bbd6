"""`deja bench sim` on a small cluster: the real policies over simulated replicas."""

from __future__ import annotations

import pytest

from bench.sim.cluster import Cluster, run_sync
from bench.sim.profile import CPU, GPU
from bench.sim.report import summarise
from bench.sim.workload import chat, llmd
from service.router.cost import CostWeights


def test_run_sync_drives_the_memory_store() -> None:
    from service.affinity.memory import MemoryAffinityStore

    store = MemoryAffinityStore()
    run_sync(store.set_session("s", "r1", 10.0))
    assert run_sync(store.get_session("s")) == "r1"


@pytest.mark.parametrize("routers", [1, 2])
def test_cost_beats_round_robin_on_multi_turn_chat(routers: int) -> None:
    wl = chat(model=CPU, num_replicas=4, utilisation=0.7, num_sessions=48, num_turns=4)
    res = {}
    for policy in ("cost", "round_robin"):
        r = Cluster(CPU, 4, policy, num_routers=routers).run(wl)
        assert len(r.records) == 48 * 4
        assert all(x.ttft_s > 0 for x in r.records)
        res[policy] = summarise(policy, r)
    cost, rr = res["cost"], res["round_robin"]
    assert cost.mean_queued > 0 and cost.max_mean_queued >= 1.0
    assert cost.hit_rate > rr.hit_rate + 0.1
    assert cost.hit_rate <= cost.oracle_hit_rate + 1e-9
    assert cost.later_turn_p50_s < rr.later_turn_p50_s


def test_prefix_records_follow_the_replicas_kv_events() -> None:
    """With KV events (the default), the store holds exactly what the replicas' tiers hold once
    the writers have flushed; with request records it is an estimate written at finish."""
    wl = chat(model=CPU, num_replicas=2, utilisation=0.7, num_sessions=16, num_turns=3)
    cluster = Cluster(CPU, 2, "cost")
    res = cluster.run(wl)
    assert len(res.records) == 16 * 3
    for rid, replica in cluster.replicas.items():
        writer = cluster.agents[rid].kv_records
        run_sync(writer.flush())
        held = set(replica.device) | set(replica.cpu)
        assert held and writer.num_held == len(held)
        tiers = run_sync(cluster.store.longest_prefix_tiers(list(replica.device)[:1]))
        assert tiers.get(rid, (0, 0, 0, 0))[0] == 1
    with pytest.raises(ValueError, match="records"):
        Cluster(CPU, 2, "cost", records="guess")


def test_events_and_holder_share_keep_a_customer_prefix_on_its_replica() -> None:
    """llm-d's shape, small: with --holder-share the cost policy keeps each customer's
    prefix where it was computed (more hits than the default bound allows)."""
    wl = llmd(model=GPU, num_replicas=4, utilisation=0.9, num_customers=12, seed=1)
    hits = {}
    for share in (0.0, 0.5):
        r = Cluster(GPU, 4, "cost", weights=CostWeights(holder_share=share)).run(wl)
        hits[share] = summarise("cost", r).hit_vs_oracle
    assert hits[0.5] > hits[0.0] + 0.05  # 0.92 -> 1.03 of the oracle's (seed 1)
    assert hits[0.5] > 0.95
