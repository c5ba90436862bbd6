"""Acceptance 3: cancellation and deadlines free every block within 1 s; SIGTERM drains."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest

from clients.client import DejaClient
from service.api.deja.v1 import inference_pb2 as pb
from tests.service.conftest import Harness, StartServer
from tests.service.serving import NOT_SERVING, health, serving
from tests.support.waiting import wait_until_sync

LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.0}
"""Several seconds of generation on the tiny model."""


async def _in_use(h: Harness) -> int:
    stats = await h.client.cache_stats()
    return stats.total_device_blocks - stats.free_device_blocks


async def test_cancel_mid_stream_frees_blocks(server: Harness) -> None:
    call = server.client.stub.Generate(
        pb.GenerateRequest(
            text="Once upon a time " * 8,
            sampling=pb.SamplingParams(max_tokens=900, ignore_eos=True, temperature=0.0),
        )
    )
    for _ in range(3):
        await call.read()
    assert await _in_use(server) > 0
    call.cancel()
    elapsed = await server.wait_blocks_free(timeout=1.0)
    print(f"blocks free {elapsed * 1e3:.0f} ms after cancel")
    await server.assert_clean()


async def test_leaving_the_client_stream_frees_blocks(server: Harness) -> None:
    n = 0
    async for _ in server.client.generate("The quick brown fox " * 8, **LONG):
        n += 1
        if n == 3:
            assert await _in_use(server) > 0
            break
    await server.wait_blocks_free(timeout=1.0)
    await server.assert_clean()


async def test_deadline_frees_blocks(server: Harness) -> None:
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        # 900 tokens take 900 steps: over 0.25 s at the tiny model's fastest step seen (0.28 ms)
        await server.client.complete("The sun rises in the east " * 8, timeout=0.2, **LONG)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 1.5
    elapsed = await server.wait_blocks_free(timeout=1.0)
    print(f"blocks free {elapsed * 1e3:.0f} ms after the deadline")
    await server.assert_clean()


# -- SIGTERM on a real `deja serve` process ----------------------------------------------------


def test_sigterm_lets_running_stream_finish(tiny_llama_path: Path, tmp_path: Path) -> None:
    with serving(tiny_llama_path, tmp_path, 30.0) as s:
        with DejaClient(s.target, retries=0, timeout=60) as client:
            stream = client.generate("Once upon a time", max_tokens=300, ignore_eos=True)
            first = next(stream)
            assert not first.HasField("final")
            s.proc.send_signal(signal.SIGTERM)
            # Draining: health NOT_SERVING, new calls refused, the running stream goes on.
            assert wait_until_sync(lambda: health(s.target) == NOT_SERVING, 10.0)
            with pytest.raises(grpc.RpcError) as info:
                client.complete("Hello", max_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            assert "draining" in info.value.details()  # type: ignore[attr-defined]
            rest = list(stream)
            assert rest[-1].final.choices[0].finish_reason == pb.FINISH_REASON_LENGTH
            assert rest[-1].final.usage.completion_tokens == 300
        assert s.proc.wait(timeout=30) == 0, s.log.read_text()
        assert "draining" in s.log.read_text()


async def test_shutdown_aborts_streams_left_after_grace(start_server: StartServer) -> None:
    """What SIGTERM does once the grace period is over (in-process: the same Replica.shutdown)."""
    h = await start_server()
    stream = h.client.generate("Once upon a time", **LONG)
    await anext(stream)
    t0 = time.monotonic()
    shutdown = asyncio.create_task(h.replica.shutdown(0.3))
    rest = [m async for m in stream]
    await shutdown
    assert rest[-1].final.choices[0].finish_reason == pb.FINISH_REASON_ABORT
    assert 0 < rest[-1].final.usage.completion_tokens < 900
    assert 0.3 <= time.monotonic() - t0 < 2.5
    assert not h.replica.servicer.streams
    stats = h.engine.get_stats()
    assert stats.free_device_blocks == h.engine.model_info.num_device_blocks
