"""A Redis that answers slowly (a delaying TCP proxy in front of a real redis-server), not only
one that stops: calls stay bounded by the store's op timeout, the store reports itself
unavailable (the router falls back to least-load routing) and recovers when Redis is fast again."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from service.affinity import AffinityStoreError, ReplicaInfo, ReplicaLoad
from service.affinity.redis_store import RedisAffinityStore
from tests.support.delay_proxy import DelayProxy
from tests.support.redis_proc import RedisProcess

# Wide enough that a loaded 2-core machine never times out a call through the fast proxy (the
# first call also connects); the slow proxy's delay stays well above it.
OP_TIMEOUT_S = 1.0
SLOW_S = 3.0


@contextlib.asynccontextmanager
async def _slow_store(
    redis_proc: RedisProcess,
    *,
    delay_s: float = 0.0,
    op_timeout_s: float = OP_TIMEOUT_S,
    reconnect_interval_s: float = 1.0,
) -> AsyncIterator[tuple[DelayProxy, RedisAffinityStore]]:
    """A store whose Redis answers through a started DelayProxy; closes both on exit."""
    proxy = DelayProxy(redis_proc.port, delay_s=delay_s)
    await proxy.start()
    store = RedisAffinityStore(
        proxy.url,
        key_prefix="slow:",
        op_timeout_s=op_timeout_s,
        reconnect_interval_s=reconnect_interval_s,
    )
    try:
        yield proxy, store
    finally:
        await store.close()
        await proxy.close()


async def test_slow_redis_below_the_timeout_still_works(redis_proc: RedisProcess) -> None:
    # NOTE: the first call also connects (several delayed round trips), hence the larger timeout.
    async with _slow_store(redis_proc, delay_s=0.05, op_timeout_s=1.0) as (_, store):
        await store.set_session("s", "a", ttl_s=60)
        for _ in range(5):
            t0 = time.monotonic()
            assert await store.get_session("s") == "a"
            assert 0.05 <= time.monotonic() - t0 < 1.0
        assert store.available


async def test_slower_than_the_timeout_is_bounded_then_recovers(redis_proc: RedisProcess) -> None:
    async with _slow_store(redis_proc, reconnect_interval_s=0.1) as (proxy, store):
        await store.register(ReplicaInfo("a", "127.0.0.1:1", "m", 16), ReplicaLoad(), ttl_s=60)
        await store.set_session("s", "a", ttl_s=60)
        proxy.delay_s = SLOW_S  # every reply now takes longer than the op timeout
        for call in (
            store.get_session("s"),
            store.list_replicas(),
            store.set_session("t", "a", 60),
        ):
            t0 = time.monotonic()
            with pytest.raises(AffinityStoreError):
                await call
            assert time.monotonic() - t0 < OP_TIMEOUT_S + 0.5
        assert not store.available
        proxy.delay_s = 0.0
        for _ in range(200):
            if store.available:
                break
            with pytest.raises(AffinityStoreError):
                await store.get_session("s")
            await asyncio.sleep(0.05)
        assert store.available
        assert await store.get_session("s") == "a"
        assert [r.info.replica_id for r in await store.list_replicas()] == ["a"]


async def test_a_slow_prefix_write_does_not_mark_the_store_down(redis_proc: RedisProcess) -> None:
    # The replica agent's background writes retry on their own; one that times out must not
    # stop the same process's heartbeats for a reconnect interval.
    info = ReplicaInfo("a", "127.0.0.1:1", "m", 16)
    async with _slow_store(redis_proc) as (proxy, store):
        await store.register(info, ReplicaLoad(), ttl_s=60)
        proxy.delay_s = SLOW_S
        t0 = time.monotonic()
        with pytest.raises(AffinityStoreError):
            await store.write_prefixes("a", {bytes(32): "device"}, ttl_s=60)
        assert time.monotonic() - t0 < OP_TIMEOUT_S + 0.5
        assert store.available
        proxy.delay_s = 0.0
        await store.register(info, ReplicaLoad(), ttl_s=60)
        await store.write_prefixes("a", {bytes(32): "cpu"}, ttl_s=60)
        assert await store.longest_prefix_tiers([bytes(32)]) == {"a": (0, 1, 0, 0)}
