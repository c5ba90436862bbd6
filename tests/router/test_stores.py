"""The affinity store contract, run against the in-memory store and a real redis-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from engine.kv.hashing import extra_keys, hash_blocks
from service.affinity import (
    AffinityStore,
    AffinityStoreError,
    ReplicaInfo,
    ReplicaLoad,
)
from service.affinity.memory import MemoryAffinityStore
from service.affinity.prefix import REMOTE_HOLDER
from service.affinity.redis_store import RedisAffinityStore
from tests.support.redis_proc import RedisProcess


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def store_and_clock(
    request: pytest.FixtureRequest, redis_proc: RedisProcess
) -> AsyncIterator[tuple[AffinityStore, FakeClock]]:
    clock = FakeClock()
    store: AffinityStore
    if request.param == "memory":
        store = MemoryAffinityStore(clock=clock)
    else:
        store = RedisAffinityStore(redis_proc.url, key_prefix="t:", clock=clock, op_timeout_s=1.0)
    yield store, clock
    await store.close()


def chain(tokens: list[int]) -> list[bytes]:
    return hash_blocks(tokens, 4, extra_keys("m"))


INFO_A = ReplicaInfo("a", "127.0.0.1:1", "m", 16)
INFO_B = ReplicaInfo("b", "127.0.0.1:2", "m", 16)


async def test_registry_heartbeat_and_ttl(store_and_clock: tuple[AffinityStore, FakeClock]) -> None:
    store, clock = store_and_clock
    await store.register(INFO_B, ReplicaLoad(1, 2, 0.5, 0.25), ttl_s=5)
    await store.register(INFO_A, ReplicaLoad(), ttl_s=5)
    live = await store.list_replicas()
    assert [s.info for s in live] == [INFO_A, INFO_B]
    assert live[1].load == ReplicaLoad(1, 2, 0.5, 0.25)
    assert live[1].updated_at == pytest.approx(clock.now)

    clock.now += 3
    await store.register(INFO_A, ReplicaLoad(num_running=7), ttl_s=5)  # a heartbeats, b does not
    clock.now += 3
    live = await store.list_replicas()
    assert [s.info.replica_id for s in live] == ["a"]
    assert live[0].load.num_running == 7

    await store.deregister("a")
    assert await store.list_replicas() == []


async def test_session_affinity(store_and_clock: tuple[AffinityStore, FakeClock]) -> None:
    store, clock = store_and_clock
    assert await store.get_session("s1") is None
    await store.set_session("s1", "a", ttl_s=10)
    assert await store.get_session("s1") == "a"
    await store.set_session("s1", "b", ttl_s=10)
    assert await store.get_session("s1") == "b"
    if isinstance(store, MemoryAffinityStore):
        clock.now += 11
        assert await store.get_session("s1") is None


async def test_longest_prefix(store_and_clock: tuple[AffinityStore, FakeClock]) -> None:
    store, clock = store_and_clock
    shared = list(range(16))  # 4 blocks
    p1 = chain([*shared, 100, 101, 102, 103, 104, 105, 106, 107])  # 6 blocks
    p2 = chain([*shared, 200, 201, 202, 203])  # 5 blocks, first 4 shared with p1
    assert p1[:4] == p2[:4] and p1[4] != p2[4]

    await store.record_prefix("a", p1, ttl_s=10)
    await store.record_prefix("b", p2[:2], ttl_s=20)
    assert await store.longest_prefix(p1) == {"a": 6, "b": 2}
    assert await store.longest_prefix(p2) == {"a": 4, "b": 2}
    assert await store.longest_prefix(chain(list(range(50, 70)))) == {}
    assert await store.longest_prefix([]) == {}

    # A sparse record (first blocks + last) still reports the full length.
    await store.record_prefix("b", [p2[0], p2[-1]], ttl_s=20)
    assert (await store.longest_prefix(p2))["b"] == 5

    # Known evictions are forgotten.
    await store.remove_prefix("a", p1[3:])
    assert (await store.longest_prefix(p1))["a"] == 3

    # Per-replica expiry inside one block's record.
    clock.now += 15
    assert await store.longest_prefix(p2) == {"b": 5}


async def test_prefix_tiers(store_and_clock: tuple[AffinityStore, FakeClock]) -> None:
    store, clock = store_and_clock
    p = chain(list(range(24)))  # 6 blocks
    await store.record_prefix("a", p[:2], ttl_s=10)  # tier-less: device
    await store.record_prefix("a", p[2:4], ttl_s=10, tier="cpu")
    await store.record_prefix("a", [p[5]], ttl_s=10, tier="disk")  # block 4 has no record
    await store.record_prefix("b", p[:3], ttl_s=10, tier="cpu")
    assert await store.longest_prefix_tiers(p) == {"a": (2, 2, 2, 0), "b": (0, 3, 0, 0)}
    assert await store.longest_prefix(p) == {"a": 6, "b": 3}
    assert await store.longest_prefix_tiers([]) == {}
    # the remote tier's records, under the shared holder
    await store.record_prefix(REMOTE_HOLDER, p[:4], ttl_s=10, tier="remote")
    held = await store.longest_prefix_tiers(p)
    assert held[REMOTE_HOLDER] == (0, 0, 0, 4) and held["b"] == (0, 3, 0, 0)
    await store.clear_prefixes(REMOTE_HOLDER)

    # A new record of a block replaces its tier; a removal drops it.
    await store.record_prefix("a", [p[2]], ttl_s=10)
    await store.remove_prefix("a", [p[5]])
    assert (await store.longest_prefix_tiers(p))["a"] == (3, 1, 0, 0)

    # Clearing one replica leaves the others.
    await store.clear_prefixes("a")
    assert await store.longest_prefix_tiers(p) == {"b": (0, 3, 0, 0)}
    await store.clear_prefixes("nobody")

    clock.now += 11
    assert await store.longest_prefix_tiers(p) == {}


async def test_write_prefixes_sets_and_removes_in_one_call(
    store_and_clock: tuple[AffinityStore, FakeClock],
) -> None:
    store, clock = store_and_clock
    p = chain(list(range(24)))  # 6 blocks
    await store.record_prefix("a", p, ttl_s=10)
    await store.write_prefixes(
        "a", {p[1]: "cpu", p[2]: "disk", p[4]: None, p[5]: None, p[3]: "device"}, ttl_s=10
    )
    assert await store.longest_prefix_tiers(p) == {"a": (2, 1, 1, 0)}
    await store.write_prefixes("a", {}, ttl_s=10)
    await store.write_prefixes("b", {p[0]: None}, ttl_s=10)  # nothing to remove
    assert await store.longest_prefix_tiers(p) == {"a": (2, 1, 1, 0)}

    # Written records are the replica's: a clear drops them.
    await store.write_prefixes("a", {p[5]: "cpu"}, ttl_s=10)
    assert await store.longest_prefix(p) == {"a": 6}
    await store.clear_prefixes("a")
    assert await store.longest_prefix(p) == {}

    await store.write_prefixes("b", {p[0]: "device"}, ttl_s=10)
    clock.now += 11
    assert await store.longest_prefix(p) == {}


def _reconnecting_store(redis_proc: RedisProcess, op_timeout_s: float) -> RedisAffinityStore:
    """A store that gives up on a call after `op_timeout_s` and retries its connection often."""
    return RedisAffinityStore(
        redis_proc.url, key_prefix="t:", op_timeout_s=op_timeout_s, reconnect_interval_s=0.1
    )


async def test_redis_down_fails_fast_and_reconnects(redis_proc: RedisProcess) -> None:
    store = _reconnecting_store(redis_proc, op_timeout_s=0.3)
    try:
        await store.set_session("s", "a", ttl_s=60)
        redis_proc.stop()
        with pytest.raises(AffinityStoreError):
            await store.get_session("s")
        assert not store.available
        t0 = time.monotonic()
        with pytest.raises(AffinityStoreError):
            await store.list_replicas()
        # Well under the 0.3 s a call would wait for Redis (room for a loaded CI machine).
        assert time.monotonic() - t0 < 0.2, "calls must fail fast while the store is down"

        redis_proc.start()
        for _ in range(100):
            if store.available:
                break
            await asyncio.sleep(0.05)
        assert store.available
        # A fresh server (no persistence): the session is gone but calls work again.
        assert await store.get_session("s") is None
        await store.set_session("s", "b", ttl_s=60)
        assert await store.get_session("s") == "b"
    finally:
        await store.close()


async def test_slow_redis_is_bounded_and_recovers(redis_proc: RedisProcess) -> None:
    store = _reconnecting_store(redis_proc, op_timeout_s=0.2)
    try:
        await store.set_session("s", "a", ttl_s=60)
        redis_proc.pause()
        t0 = time.monotonic()
        with pytest.raises(AffinityStoreError):
            await store.get_session("s")
        assert time.monotonic() - t0 < 0.5
        assert not store.available
        redis_proc.resume()
        for _ in range(100):
            if store.available:
                break
            await asyncio.sleep(0.05)
        assert await store.get_session("s") == "a"
    finally:
        redis_proc.resume()
        await store.close()


async def test_redis_unreachable_is_bounded_in_time() -> None:
    from service.common.ports import free_port

    store = RedisAffinityStore(f"redis://127.0.0.1:{free_port()}/0", op_timeout_s=0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(AffinityStoreError):
            await store.ping()
        assert time.monotonic() - t0 < 0.5
    finally:
        await store.close()


async def test_key_prefix_separates_deployments(redis_proc: RedisProcess) -> None:
    one = RedisAffinityStore(redis_proc.url, key_prefix="one:")
    two = RedisAffinityStore(redis_proc.url, key_prefix="two:")
    try:
        await one.set_session("s", "a", ttl_s=60)
        await one.register(INFO_A, ReplicaLoad(), ttl_s=60)
        assert await two.get_session("s") is None
        assert await two.list_replicas() == []
    finally:
        await one.close()
        await two.close()
