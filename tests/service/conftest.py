"""Fixtures: a real engine on the tiny random Llama — by default the engine core in its own process,
as `deja serve` runs it — real grpc.aio servers on free ports, and real clients."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from clients.client import AsyncDejaClient
from engine.config import EngineConfig
from engine.frontend.async_engine import AsyncEngine
from engine.frontend.core_client import EngineCoreClient
from service.replica.config import ServiceConfig
from service.replica.server import Replica, serve

ENGINE_KWARGS: dict[str, Any] = {
    "num_device_blocks": 512,
    "block_size": 16,
    "max_model_len": 1024,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 1024,
    "cpu_swap_gib": 0.0,
}
"""The tiny test engine (also what offline comparisons use)."""


Engine = AsyncEngine | EngineCoreClient


def make_engine(
    path: Path, *, stream_buffer: int = 1024, in_process: bool = False, **overrides: Any
) -> Engine:
    """A started engine on `path` with ENGINE_KWARGS (overridable): the engine core in its own
    process (what `deja serve` runs), or with `in_process` the step loop in a thread."""
    config = EngineConfig.from_kwargs(str(path), **{**ENGINE_KWARGS, **overrides})
    if not in_process:
        return EngineCoreClient(config, stream_buffer=stream_buffer)
    engine = AsyncEngine.from_config(config, stream_buffer=stream_buffer)
    engine.start()
    return engine


@pytest.fixture(scope="session")
def engine(tiny_llama_path: Path) -> Iterator[Engine]:
    """One engine shared by the module's servers; tests must leave it idle."""
    eng = make_engine(tiny_llama_path)
    yield eng
    eng.shutdown()


@dataclass
class Harness:
    replica: Replica
    client: AsyncDejaClient
    engine: Engine

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.replica.port}"

    async def wait_blocks_free(self, timeout: float = 1.0) -> float:
        """Seconds until every device block is free again (fails after `timeout`)."""
        t0 = time.monotonic()
        while True:
            stats = await self.client.cache_stats()
            if stats.free_device_blocks == stats.total_device_blocks:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise AssertionError(
                    f"{stats.total_device_blocks - stats.free_device_blocks} blocks still in use "
                    f"after {timeout} s"
                )
            await asyncio.sleep(0.01)

    async def assert_clean(self, timeout: float = 1.0) -> None:
        """Nothing leaked: no open streams, no engine requests, every block free."""
        await self.wait_blocks_free(timeout)
        t0 = time.monotonic()
        while self.replica.servicer.streams or _busy(self.engine):
            assert time.monotonic() - t0 < timeout, "a stream or engine request leaked"
            await asyncio.sleep(0.01)


def _busy(engine: Engine) -> bool:
    s = engine.get_stats()
    return bool(s.num_running or s.num_waiting)


StartServer = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def start_server(engine: Engine) -> AsyncIterator[StartServer]:
    """start_server(engine=None, tracer_provider=None, token=None, **ServiceConfig fields)."""
    started: list[Harness] = []

    async def start(
        engine_: Engine | None = None,
        *,
        tracer_provider: TracerProvider | None = None,
        token: str | None = None,
        client_tracer_provider: TracerProvider | None = None,
        **overrides: Any,
    ) -> Harness:
        cfg = ServiceConfig(**{"port": 0, "grace_period_s": 1.0, **overrides})
        eng = engine_ or engine
        replica = await serve(cfg, eng, tracer_provider=tracer_provider, monitor_interval_s=0.05)
        client = AsyncDejaClient(
            f"127.0.0.1:{replica.port}",
            token=token,
            retries=0,
            tracer_provider=client_tracer_provider,
        )
        h = Harness(replica, client, eng)
        started.append(h)
        return h

    yield start
    for h in started:
        await h.client.close()
        if not h.replica.servicer.draining:
            await h.replica.shutdown(0.0)


@pytest.fixture
async def server(start_server: StartServer) -> Harness:
    return await start_server()
