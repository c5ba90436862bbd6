"""`deja bench sim` on a small cluster: the real policies over simulated replicas."""

from __future__ import annotations

import pytest

from bench.sim.cluster import Cluster, run_sync
from bench.sim.profile import CPU
from bench.sim.report import summarise
from bench.sim.workload import chat


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
