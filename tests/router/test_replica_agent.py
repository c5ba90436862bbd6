"""The replica agent: registration, heartbeat with load, records, and Redis outages."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from engine.frontend.prompt import prompt_block_hashes
from engine.stats import EngineStats
from service.affinity import AffinityConfig, ReplicaInfo
from service.affinity.memory import MemoryAffinityStore
from service.affinity.redis_store import RedisAffinityStore
from service.replica.agent import ReplicaAgent
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_until

INFO = ReplicaInfo("r1", "127.0.0.1:5001", "tiny", 4)
CONFIG = AffinityConfig(heartbeat_s=0.05, replica_ttl_s=0.5, max_blocks_per_record=3)


def stats() -> EngineStats:
    return EngineStats(num_running=2, num_waiting=1, kv_usage=0.25, prefix_queries=4, prefix_hits=1)


async def test_register_heartbeat_and_record() -> None:
    store = MemoryAffinityStore()
    agent = ReplicaAgent(store, INFO, stats, CONFIG, capacity_blocks=100)
    await agent.start()
    (status,) = await store.list_replicas()
    assert status.info == INFO
    assert (status.load.num_running, status.load.num_waiting) == (2, 1)
    assert status.load.hit_rate == 0.25

    prompt = list(range(22))  # 5 full blocks of 4
    agent.record("sess", prompt, "salt")
    await agent.flush()
    assert await store.get_session("sess") == "r1"
    chain = prompt_block_hashes(prompt, 4, "tiny", "salt")
    # Bounded to 3 hashes (first two + last), the last still stands for all 5 blocks.
    assert await store.longest_prefix(chain) == {"r1": 5}
    assert await store.longest_prefix(chain[:4]) == {"r1": 2}
    assert await store.longest_prefix(prompt_block_hashes(prompt, 4, "tiny", None)) == {}

    await agent.stop()
    assert not store.available


async def test_stops_heartbeating_drops_out() -> None:
    store = MemoryAffinityStore()
    agent = ReplicaAgent(store, INFO, stats, CONFIG, capacity_blocks=100)
    await agent.start()

    async def registered() -> bool:
        return len(await store.list_replicas()) == 1

    async def gone() -> bool:
        return await store.list_replicas() == []

    await wait_until(registered, what="the replica registers")
    assert agent._heartbeat is not None
    agent._heartbeat.cancel()  # a replica that hangs: no heartbeat, no deregistration
    await wait_until(gone, what="its record expires")


async def test_local_lru_removes_records_it_knows_are_evicted() -> None:
    store = MemoryAffinityStore()
    config = AffinityConfig(max_blocks_per_record=100)
    agent = ReplicaAgent(store, INFO, stats, config, capacity_blocks=4)
    a, b = list(range(100, 116)), list(range(200, 216))  # 4 blocks each
    await agent.record_now("", a, None)
    await agent.record_now("", b, None)  # pushes a's 4 blocks out of a 4-block cache
    assert await store.longest_prefix(prompt_block_hashes(a, 4, "tiny", None)) == {}
    assert await store.longest_prefix(prompt_block_hashes(b, 4, "tiny", None)) == {"r1": 4}


async def test_redis_down_never_raises_and_counts(redis_proc: RedisProcess) -> None:
    registry = CollectorRegistry()
    store = RedisAffinityStore(redis_proc.url, op_timeout_s=0.3, reconnect_interval_s=0.1)
    agent = ReplicaAgent(store, INFO, stats, CONFIG, capacity_blocks=100, registry=registry)
    await agent.start()
    assert await agent.record_now("s", list(range(8)), None)
    redis_proc.stop()
    assert not await agent.record_now("s", list(range(8)), None)
    agent.record("s", list(range(8)), None)
    await agent.flush()
    errors = registry.get_sample_value("deja_affinity_store_errors_total", {"op": "set_session"})
    assert errors is not None and errors >= 2
    assert registry.get_sample_value("deja_affinity_records_total", {"result": "failed"}) == 2

    redis_proc.start()

    async def reregistered() -> bool:  # reconnect, then the heartbeat re-registers
        return store.available and bool(await store.list_replicas())

    await wait_until(reregistered, what="the agent re-registers on the fresh server")
    assert [s.info.replica_id for s in await store.list_replicas()] == ["r1"]
    await agent.stop()


async def test_restarted_replica_republishes_what_its_disk_tier_holds(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    from engine import LLM, SamplingParams
    from engine.config import EngineConfig
    from engine.frontend.async_engine import AsyncEngine

    prompt = [(7 * i) % 400 + 10 for i in range(200)]  # 12 full blocks of 16
    llm = LLM(
        str(tiny_llama_path),
        block_size=16,
        num_device_blocks=64,
        num_cpu_blocks=8,
        disk_dir=str(tmp_path),
    )
    llm.generate([prompt], SamplingParams(max_tokens=2))
    assert llm.engine.close(timeout_s=30.0)

    config = EngineConfig.from_kwargs(
        str(tiny_llama_path),
        block_size=16,
        num_device_blocks=64,
        num_cpu_blocks=8,
        disk_dir=str(tmp_path),
    )
    engine = AsyncEngine.from_config(config)
    engine.start()
    try:
        info = ReplicaInfo("r9", "127.0.0.1:5009", engine.model_info.model_id, 16)
        store = MemoryAffinityStore()
        agent = ReplicaAgent(
            store,
            info,
            stats,
            AffinityConfig(),
            capacity_blocks=72,
            cached_hashes=engine.cached_block_hashes,
        )
        await agent.start()
        await agent.flush()
        chain = prompt_block_hashes(prompt, 16, engine.model_info.model_id, None)
        assert len(chain) == 12
        assert await store.longest_prefix(chain) == {"r9": 12}
        await agent.stop()
    finally:
        engine.shutdown(5.0)
