"""The engine core in its own process: parity with the offline engine, crash isolation, and no
orphan processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import DejaClient
from engine import LLM, SamplingParams
from engine.frontend.core_client import EngineCoreClient
from service.common.failover import ENGINE_DEAD_KEY, engine_dead_before_output
from tests.service.conftest import ENGINE_KWARGS, StartServer, make_engine
from tests.service.serving import NOT_SERVING, alive, health, serving
from tests.support.waiting import wait_until_sync


async def test_core_process_matches_offline_greedy(
    start_server: StartServer, engine: EngineCoreClient, tiny_llama_path: Path
) -> None:
    assert isinstance(engine, EngineCoreClient) and engine.pid != os.getpid()
    h = await start_server()
    prompts = ["Once upon a time", "The quick brown fox jumps", "Hello " * 40]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    offline = LLM(model=str(tiny_llama_path), **ENGINE_KWARGS).generate(prompts, params)
    for prompt, ref in zip(prompts, offline, strict=True):
        ids: list[int] = []
        async for msg in h.client.generate(
            prompt, max_tokens=24, ignore_eos=True, temperature=0.0, return_token_ids=True
        ):
            for choice in msg.choices:
                ids.extend(choice.token_ids)
        assert ids == ref.token_ids
    await h.assert_clean()


async def test_async_scheduling_core_matches_offline_and_cancels_clean(
    start_server: StartServer, tiny_llama_path: Path
) -> None:
    """`deja serve --async-scheduling`: the core process leaves steps in flight; concurrent
    streams get the offline engine's greedy tokens, and a stream cancelled mid-way (its next
    token in flight) frees every block."""
    engine = make_engine(tiny_llama_path, async_scheduling=True)
    try:
        h = await start_server(engine)
        prompts = ["Once upon a time", "The quick brown fox jumps", "Hello " * 40]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        offline = LLM(model=str(tiny_llama_path), **ENGINE_KWARGS).generate(prompts, params)

        async def tokens(prompt: str) -> list[int]:
            ids: list[int] = []
            async for msg in h.client.generate(
                prompt, max_tokens=24, ignore_eos=True, temperature=0.0, return_token_ids=True
            ):
                for choice in msg.choices:
                    ids.extend(choice.token_ids)
            return ids

        got = await asyncio.gather(*(tokens(p) for p in prompts))
        assert got == [ref.token_ids for ref in offline]
        n = 0
        async for _ in h.client.generate("Once upon a time " * 8, max_tokens=900, ignore_eos=True):
            n += 1
            if n == 3:
                break
        await h.wait_blocks_free(timeout=2.0)
        await h.assert_clean(2.0)
    finally:
        engine.shutdown(0.0)


async def test_killed_core_fails_streams_and_turns_not_serving(
    start_server: StartServer, tiny_llama_path: Path
) -> None:
    engine = make_engine(tiny_llama_path)
    assert isinstance(engine, EngineCoreClient) and engine.pid is not None
    try:
        h = await start_server(engine)
        stream = h.client.generate("Once upon a time", max_tokens=900, ignore_eos=True)
        await anext(stream)
        os.kill(engine.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stream:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # the caller may go elsewhere
        assert "engine core" in (info.value.details() or "")
        assert time.monotonic() - t0 < 2.0
        # the trailer the router reads (service/failover.py): a token was already sent
        trailer = dict(info.value.trailing_metadata() or ())
        assert int(trailer[ENGINE_DEAD_KEY]) >= 1
        assert not engine_dead_before_output(info.value.trailing_metadata())
        async with grpc.aio.insecure_channel(h.target) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="deja.v1.Inference")
            )
        assert resp.status == NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await h.client.complete("Hello", max_tokens=3)
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "has failed" in (again.value.details() or "")
        assert not h.replica.servicer.streams
    finally:
        engine.shutdown(0.0)


def test_deja_serve_exits_nonzero_when_its_core_dies(tiny_llama_path: Path, tmp_path: Path) -> None:
    with serving(tiny_llama_path, tmp_path, 30.0) as s:
        with DejaClient(s.target, retries=0, timeout=60) as client:
            stream = client.generate("Once upon a time", max_tokens=900, ignore_eos=True)
            next(stream)
            os.kill(s.core, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        assert s.proc.wait(timeout=20) == 1, s.log.read_text()
        assert "engine" in s.log.read_text()


def test_core_exits_when_deja_serve_is_killed(tiny_llama_path: Path, tmp_path: Path) -> None:
    with serving(tiny_llama_path, tmp_path, 30.0) as s:
        s.proc.kill()
        s.proc.wait()
        assert health(s.target, timeout=0.5) is None
        assert wait_until_sync(lambda: not alive(s.core), 10.0), (
            "the engine core outlived its API server"
        )


def test_sigterm_stops_core_cleanly(tiny_llama_path: Path, tmp_path: Path) -> None:
    with serving(tiny_llama_path, tmp_path, 5.0) as s:
        with DejaClient(s.target, retries=0, timeout=60) as client:
            out = client.complete("Hello", max_tokens=4, ignore_eos=True)
            assert out.final is not None and out.final.usage.completion_tokens == 4
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=30) == 0, s.log.read_text()
        assert wait_until_sync(lambda: not alive(s.core), 5.0)


def test_start_failure_is_reported(tmp_path: Path) -> None:
    from engine.config import EngineConfig

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="engine core failed to start"):
        EngineCoreClient(EngineConfig.from_kwargs(str(tmp_path)), start_timeout_s=120)
