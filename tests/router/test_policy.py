"""Routing decisions, rendezvous hashing and the recorded prefix chain."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from service.affinity.prefix import bounded_chain
from service.affinity.rendezvous import rendezvous_order, rendezvous_pick
from service.router.policy import (
    Candidate,
    NoReplicaError,
    OverloadGuard,
    RouteInputs,
    decide,
)

GUARD = OverloadGuard(max_waiting=2, max_kv_usage=0.9, max_imbalance=3)
ABC = [Candidate("a"), Candidate("b"), Candidate("c")]


def test_rendezvous_is_stable_and_minimal_on_removal() -> None:
    nodes = ["r1", "r2", "r3", "r4"]
    keys = [f"session-{i}" for i in range(2000)]
    before = {k: rendezvous_pick(k, nodes) for k in keys}
    assert before == {k: rendezvous_pick(k, list(reversed(nodes))) for k in keys}
    counts = Counter(before.values())
    assert all(350 < counts[n] < 650 for n in nodes), counts
    after = {k: rendezvous_pick(k, ["r1", "r2", "r4"]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r3" for k in moved)
    assert rendezvous_order("k", []) == [] and rendezvous_pick("k", []) is None


def test_bounded_chain() -> None:
    chain = [bytes([i]) * 32 for i in range(10)]
    assert bounded_chain(chain, 10) == chain
    assert bounded_chain(chain, 4) == [*chain[:3], chain[9]]
    assert bounded_chain(chain, 1) == [chain[9]]


@pytest.mark.parametrize(
    "inputs",
    [
        RouteInputs("s", session_replica="b", prefix_blocks={"a": 9}),
        RouteInputs("new", prefix_blocks={"a": 3, "c": 3}),
        RouteInputs("k"),
        RouteInputs("k", store_ok=False),
    ],
)
def test_decision_does_not_depend_on_the_candidates_order(inputs: RouteInputs) -> None:
    """Every router process (and every poll order) makes the same choice for the same state."""
    cands = [Candidate("a", running=1), Candidate("b"), Candidate("c", waiting=1), Candidate("d")]
    want = decide("affinity", cands, inputs, GUARD)
    for perm in itertools.permutations(cands):
        assert decide("affinity", list(perm), inputs, GUARD) == want


def test_session_wins_when_healthy_and_not_overloaded() -> None:
    inputs = RouteInputs("s", session_replica="b", prefix_blocks={"a": 9})
    d = decide("affinity", ABC, inputs, GUARD)
    assert (d.replica_id, d.reason) == ("b", "session")
    # The session's replica is busier than the others but not overloaded: stay.
    busy = [Candidate("a"), Candidate("b", running=10, inflight=10), Candidate("c")]
    assert decide("affinity", busy, inputs, GUARD).reason == "session"


def test_overloaded_session_replica_moves_to_prefix_then_load() -> None:
    hot = [Candidate("a"), Candidate("b", waiting=3), Candidate("c")]
    d = decide("affinity", hot, RouteInputs("s", "b", {"a": 2, "b": 9, "c": 1}), GUARD)
    assert (d.replica_id, d.reason, d.prefix_blocks) == ("a", "prefix", 2)
    full = [Candidate("a"), Candidate("b", kv_usage=0.95), Candidate("c", running=1)]
    d = decide("affinity", full, RouteInputs("s", "b"), GUARD)
    assert (d.replica_id, d.reason) == ("a", "load")


def test_dead_session_replica_moves() -> None:
    d = decide("affinity", ABC, RouteInputs("s", session_replica="gone"), GUARD)
    assert d.reason == "load" and d.replica_id in {"a", "b", "c"}


def test_longest_prefix_wins_unless_much_busier() -> None:
    inputs = RouteInputs("new", prefix_blocks={"a": 3, "c": 7})
    d = decide("affinity", ABC, inputs, GUARD)
    assert (d.replica_id, d.reason, d.prefix_blocks) == ("c", "prefix", 7)
    # c is 4 requests busier than the least loaded (> max_imbalance 3): next best holder.
    busy = [Candidate("a", inflight=1), Candidate("b"), Candidate("c", inflight=4)]
    d = decide("affinity", busy, inputs, GUARD)
    assert (d.replica_id, d.reason) == ("a", "prefix")
    # Equal prefixes: the less loaded holder.
    tie = [Candidate("a", inflight=2), Candidate("b"), Candidate("c", inflight=1)]
    d = decide("affinity", tie, RouteInputs("new", prefix_blocks={"a": 5, "c": 5}), GUARD)
    assert d.replica_id == "c"


def test_least_load_spreads_new_sessions() -> None:
    picks = Counter(
        decide("affinity", ABC, RouteInputs(f"s{i}"), GUARD).replica_id for i in range(300)
    )
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 60
    loaded = [Candidate("a", running=3), Candidate("b", inflight=1), Candidate("c", running=2)]
    d = decide("affinity", loaded, RouteInputs("s"), GUARD)
    assert (d.replica_id, d.reason) == ("b", "load")


def test_store_down_uses_rendezvous_over_healthy() -> None:
    for i in range(50):
        key = f"s{i}"
        inputs = RouteInputs(key, session_replica=None, store_ok=False)
        d = decide("affinity", ABC, inputs, GUARD)
        assert d.reason == "fallback"
        assert d.replica_id == rendezvous_pick(key, ["a", "b", "c"])
    # An overloaded replica is skipped.
    key = next(f"s{i}" for i in range(100) if rendezvous_pick(f"s{i}", ["a", "b", "c"]) == "a")
    hot = [Candidate("a", waiting=5), Candidate("b"), Candidate("c")]
    d = decide("affinity", hot, RouteInputs(key, store_ok=False), GUARD)
    assert d.replica_id == rendezvous_pick(key, ["b", "c"])


def test_all_overloaded_still_routes() -> None:
    hot = [Candidate("a", waiting=9), Candidate("b", waiting=5)]
    d = decide("affinity", hot, RouteInputs("s", session_replica="a"), GUARD)
    assert (d.replica_id, d.reason) == ("b", "load")


def test_round_robin_and_prefix_only() -> None:
    inputs = RouteInputs("s", session_replica="b", prefix_blocks={"c": 4})
    assert [decide("round_robin", ABC, inputs, GUARD, i).replica_id for i in range(4)] == [
        "a",
        "b",
        "c",
        "a",
    ]
    assert decide("round_robin", ABC, inputs, GUARD).reason == "round_robin"
    d = decide("prefix_only", ABC, inputs, GUARD)
    assert (d.replica_id, d.reason) == ("c", "prefix")


def test_errors() -> None:
    with pytest.raises(NoReplicaError):
        decide("affinity", [], RouteInputs("s"), GUARD)
    with pytest.raises(ValueError):
        decide("sticky", ABC, RouteInputs("s"), GUARD)
    with pytest.raises(ValueError):
        OverloadGuard(max_kv_usage=0)
