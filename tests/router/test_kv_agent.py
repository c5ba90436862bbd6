"""The replica agent's prefix records follow the engine's KV events (real engines, real stores)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.prompt import prompt_block_hashes
from engine.sample.sampling_params import SamplingParams
from engine.stats import EngineStats
from service.affinity import AffinityConfig, AffinityStore, ReplicaInfo
from service.affinity.memory import MemoryAffinityStore
from service.affinity.prefix import REMOTE_HOLDER, with_shared_tier
from service.affinity.redis_store import RedisAffinityStore
from service.replica.agent import ReplicaAgent
from service.replica.kv_events import KvEventRing
from service.router.cost import CostWeights, held_blocks
from tests.support.redis_proc import RedisProcess
from tests.support.thread_proxy import ThreadDelayProxy
from tests.support.waiting import wait_until

BS = 16


def start_engine(path: Path, **kwargs: object) -> AsyncEngine:
    config = EngineConfig.from_kwargs(
        str(path), block_size=BS, max_model_len=128, cpu_swap_gib=0.0, **kwargs
    )
    engine = AsyncEngine.from_config(config)
    engine.start()
    return engine


async def start_agent(
    engine: AsyncEngine, store: AffinityStore, replica_id: str = "r1"
) -> tuple[ReplicaAgent, KvEventRing]:
    ring = KvEventRing(engine.kv_snapshot, capacity=64)
    engine.set_kv_event_sink(ring.publish)
    info = ReplicaInfo(replica_id, "127.0.0.1:1", engine.model_info.model_id, BS)
    agent = ReplicaAgent(
        store,
        info,
        EngineStats,
        AffinityConfig(),
        capacity_blocks=1,  # the LRU estimate would evict everything: events must not use it
        kv_events=ring.subscribe,
    )
    await agent.start()
    return agent, ring


async def generate(engine: AsyncEngine, prompt: list[int], rid: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2)
    async for _ in engine.generate(prompt, params, request_id=rid):
        pass


@pytest.fixture
def small_engine(tiny_llama_path: Path) -> Iterator[AsyncEngine]:
    """8 device blocks over an 8-block CPU tier."""
    engine = start_engine(tiny_llama_path, num_device_blocks=8, num_cpu_blocks=8)
    yield engine
    engine.shutdown(5.0)


@pytest.fixture
async def memory_store() -> AsyncIterator[MemoryAffinityStore]:
    store = MemoryAffinityStore()
    yield store
    await store.close()


async def test_records_follow_eviction_and_cpu_tier(
    small_engine: AsyncEngine, memory_store: MemoryAffinityStore
) -> None:
    engine, store = small_engine, memory_store
    agent, ring = await start_agent(engine, store)
    model = engine.model_info.model_id
    a = list(range(10, 90))  # 5 full blocks
    b = list(range(300, 380))
    chain_a = prompt_block_hashes(a, BS, model, None)
    chain_b = prompt_block_hashes(b, BS, model, None)

    await generate(engine, a, "a")

    async def holds_a_on_device() -> bool:
        return await store.longest_prefix_tiers(chain_a) == {"r1": (5, 0, 0, 0)}

    await wait_until(holds_a_on_device, what="a's 5 blocks recorded on the device")
    # The agent's estimate is not used: a capacity of 1 block would have removed them all.

    await generate(engine, b, "b")  # 6 of the 8 device blocks: a's tail blocks are reused

    async def a_moved_to_cpu() -> bool:
        tiers = (await store.longest_prefix_tiers(chain_a)).get("r1", (0, 0, 0, 0))
        return tiers[1] > 0 and sum(tiers) == 5

    await wait_until(a_moved_to_cpu, what="a's reused blocks recorded in the CPU tier")
    assert await store.longest_prefix_tiers(chain_b) == {"r1": (5, 0, 0, 0)}
    tiers = await store.longest_prefix_tiers(chain_a)
    dev, cpu, _, _ = held_blocks("r1", None, tiers)
    assert (dev, cpu) == (5 - cpu, cpu) and cpu >= 2
    # The cost policy credits a CPU block 0.75 of a device block.
    assert CostWeights().credit(held_blocks("r1", None, tiers)) == dev + 0.75 * cpu

    await agent.stop()
    ring.close()


async def test_eviction_without_a_cpu_tier_removes_records(
    tiny_llama_path: Path, memory_store: MemoryAffinityStore
) -> None:
    engine = start_engine(tiny_llama_path, num_device_blocks=8)
    try:
        store = memory_store
        agent, ring = await start_agent(engine, store)
        model = engine.model_info.model_id
        a, b = list(range(10, 90)), list(range(300, 380))
        chain_a = prompt_block_hashes(a, BS, model, None)
        await generate(engine, a, "a")

        async def recorded(n: int) -> bool:
            return (await store.longest_prefix(chain_a)).get("r1", 0) == n

        await wait_until(lambda: recorded(5), what="a recorded")
        await generate(engine, b, "b")
        evicted = [h for h in chain_a if engine.engine.kv.pool.lookup(h) is None]
        assert evicted, "b must have reused some of a's blocks"

        async def evicted_gone() -> bool:
            held = await store.longest_prefix_tiers(chain_a)
            return sum(held.get("r1", (0, 0, 0, 0))) == 5 - len(evicted)

        await wait_until(evicted_gone, what="a's evicted blocks removed from the store")
        await agent.stop()
        ring.close()
    finally:
        engine.shutdown(5.0)


async def test_overflow_clears_and_resyncs(
    tiny_llama_path: Path, memory_store: MemoryAffinityStore
) -> None:
    # A 2-block event buffer: a 5-block prompt overflows it; the batch is cleared + snapshot.
    engine = start_engine(tiny_llama_path, num_device_blocks=16, kv_events_max_blocks=2)
    try:
        store = memory_store
        await store.record_prefix("r1", [b"\x01" * 32], ttl_s=60)  # a record no engine holds
        agent, ring = await start_agent(engine, store)
        a = list(range(10, 90))
        chain_a = prompt_block_hashes(a, BS, engine.model_info.model_id, None)
        await generate(engine, a, "a")

        async def resynced() -> bool:
            return await store.longest_prefix_tiers(chain_a) == {"r1": (5, 0, 0, 0)}

        await wait_until(resynced, what="the snapshot after the overflow applied")
        assert await store.longest_prefix([b"\x01" * 32]) == {}
        assert engine.engine.kv_events is not None and engine.engine.kv_events.num_overflows
        await agent.stop()
        ring.close()
    finally:
        engine.shutdown(5.0)


async def test_restarted_replica_records_are_rebuilt_from_the_snapshot(
    tiny_llama_path: Path, tmp_path: Path, redis_proc: RedisProcess
) -> None:
    kwargs = {"num_device_blocks": 16, "num_cpu_blocks": 8, "disk_dir": str(tmp_path)}
    a, b = list(range(10, 90)), list(range(300, 364))
    first = start_engine(tiny_llama_path, **kwargs)
    model = first.model_info.model_id
    chain_a = prompt_block_hashes(a, BS, model, None)
    chain_b = prompt_block_hashes(b, BS, model, None)
    store = RedisAffinityStore(redis_proc.url, key_prefix="kv:", op_timeout_s=1.0)
    try:
        agent, ring = await start_agent(first, store, "r9")
        await generate(first, a, "a")
        await generate(first, b, "b")

        async def both_on_device() -> bool:
            held_a = await store.longest_prefix_tiers(chain_a)
            return held_a == {"r9": (5, 0, 0, 0)} and await store.longest_prefix(chain_b) == {
                "r9": 4
            }

        await wait_until(both_on_device, what="the first life's records")
        await agent.stop()
        ring.close()
        first.shutdown(10.0)  # flushes a's and b's blocks to disk (write-through)
        # The new life holds a only (b's files are gone, as after a disk loss).
        for h in chain_b:
            for f in tmp_path.glob(f"*/{h.hex()}.kv"):
                f.unlink()

        store = RedisAffinityStore(redis_proc.url, key_prefix="kv:", op_timeout_s=1.0)
        assert (await store.longest_prefix(chain_b)) == {"r9": 4}  # stale until the snapshot
        second = start_engine(tiny_llama_path, **kwargs)
        try:
            agent, ring = await start_agent(second, store, "r9")

            async def rebuilt() -> bool:
                return (
                    await store.longest_prefix_tiers(chain_a) == {"r9": (0, 0, 5, 0)}
                    and await store.longest_prefix(chain_b) == {}
                )

            await wait_until(rebuilt, what="records rebuilt from the restarted replica's snapshot")
            await agent.stop()
            ring.close()
        finally:
            second.shutdown(5.0)
    finally:
        await store.close()


async def test_remote_tier_records_are_shared_and_outlive_the_replica(
    tiny_llama_path: Path, redis_proc: RedisProcess
) -> None:
    """A replica with a remote tier records what it stored there under REMOTE_HOLDER (its own
    records stay its own); its restart clears its records but not the shared ones, which the
    router credits to every replica. The KV store answers through a delaying proxy, so its
    acknowledgements arrive after the request's last step: an idle engine announces them."""
    store = RedisAffinityStore(redis_proc.url, key_prefix="rt:", op_timeout_s=1.0)
    proxy = ThreadDelayProxy(redis_proc.port, delay_s=0.2)
    kv_url = proxy.url.removesuffix("/0") + "/1"  # the KV values in another database
    engine = start_engine(
        tiny_llama_path,
        num_device_blocks=32,
        num_cpu_blocks=8,
        kv_remote=kv_url,
        kv_remote_timeout_s=5.0,
    )
    try:
        agent, ring = await start_agent(engine, store, "r1")
        a = list(range(10, 90))  # 5 full blocks, 4 cached by a prompt that ends in the 5th
        chain = prompt_block_hashes(a, BS, engine.model_info.model_id, None)
        await generate(engine, a, "a")

        seen: list[object] = []

        async def shared() -> bool:
            held = await store.longest_prefix_tiers(chain)
            seen[:] = [held]
            return held.get(REMOTE_HOLDER) == (0, 0, 0, 5) and held.get("r1") == (5, 0, 0, 0)

        try:
            await wait_until(shared, what="5 blocks recorded for r1 and for the shared tier")
        except AssertionError as e:
            raise AssertionError(f"{e}; the store last held {seen}") from None
        await agent.stop()  # closes its store
        ring.close()
        store = RedisAffinityStore(redis_proc.url, key_prefix="rt:", op_timeout_s=1.0)
        await store.clear_prefixes("r1")  # what a restart does first
        held = await store.longest_prefix_tiers(chain)
        assert held == {REMOTE_HOLDER: (0, 0, 0, 5)}
        assert with_shared_tier(held, ["r1", "r2"]) == {"r1": (0, 0, 0, 5), "r2": (0, 0, 0, 5)}
    finally:
        engine.shutdown(5.0)
        await store.close()
        proxy.close()
