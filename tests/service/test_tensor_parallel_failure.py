"""A tensor-parallel worker that dies: the replica turns NOT_SERVING
within 5 s with a clear log line, the open stream fails instead of hanging, new calls get
UNAVAILABLE, and `deja serve --tensor-parallel-size 2` exits non-zero so it is restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import DejaClient
from engine.frontend.core_client import EngineCoreClient
from service.common.failover import engine_dead_sent
from service.common.ports import free_port
from service.common.rpc import SERVICE_NAME
from tests.service.conftest import StartServer, make_engine
from tests.service.serving import NOT_SERVING, alive, core_of, wait_serving
from tests.support.waiting import wait_until, wait_until_sync

WORKER_MODULE = b"engine.worker.parallel.worker"


def tp_workers(core: int) -> list[int]:
    """The tensor-parallel worker processes the engine core started."""
    with open(f"/proc/{core}/task/{core}/children") as f:
        children = [int(p) for p in f.read().split()]
    out = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if WORKER_MODULE in f.read():
                out.append(child)
    return out


async def test_killed_worker_turns_not_serving_and_fails_streams(
    start_server: StartServer, tiny_llama_path: Path
) -> None:
    engine = make_engine(tiny_llama_path, tensor_parallel_size=2)
    assert isinstance(engine, EngineCoreClient) and engine.pid is not None
    try:
        h = await start_server(engine)
        (worker,) = tp_workers(engine.pid)
        stream = h.client.generate("Once upon a time", max_tokens=900, ignore_eos=True)
        await anext(stream)
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stream:
                pass
        # the replica cannot serve: UNAVAILABLE, with the router's trailer (a token was sent)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine" in (info.value.details() or "")
        assert (engine_dead_sent(info.value.trailing_metadata()) or 0) >= 1
        async with grpc.aio.insecure_channel(h.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)

            async def not_serving() -> bool:
                req = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
                return (await stub.Check(req)).status == NOT_SERVING

            await wait_until(not_serving, 5.0 - (time.monotonic() - t0), what="NOT_SERVING")
        assert time.monotonic() - t0 < 5.0, "health did not turn NOT_SERVING within 5 s"
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await h.client.complete("Hello", max_tokens=3)
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE
        assert wait_until_sync(lambda: not alive(engine.pid or 0), 5.0), "the core outlived it"
    finally:
        engine.shutdown(0.0)


def test_deja_serve_exits_nonzero_when_a_worker_dies(tiny_llama_path: Path, tmp_path: Path) -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    cmd = [
        sys.executable, "-m", "service.cli", "serve", "--model", str(tiny_llama_path),
        "--port", str(port), "--num-device-blocks", "256", "--max-model-len", "1024",
        "--cpu-swap-gib", "0", "--tensor-parallel-size", "2",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    root = Path(__file__).resolve().parents[2]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT)
    core, workers = None, []
    try:
        wait_serving(proc, target, log)
        core = core_of(proc.pid)
        workers = tp_workers(core)
        assert len(workers) == 1
        with DejaClient(target, retries=0, timeout=60) as client:
            stream = client.generate("Once upon a time", max_tokens=900, ignore_eos=True)
            next(stream)
            os.kill(workers[0], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError):
                list(stream)
        assert proc.wait(timeout=20) == 1, log.read_text()
        assert time.monotonic() - t0 < 5.0
        text = log.read_text()
        assert "tensor-parallel worker rank 1" in text and "exited" in text, text
        assert wait_until_sync(lambda: not alive(core or 0), 5.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in [core, *workers]:
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
