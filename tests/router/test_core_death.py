"""A replica's engine core dies under open streams (issue 15, fault injection): a real round-robin
`deja route` in front of two `deja serve` replicas (tiny model), each a separate process.

The router retries a stream on the other replica when the replica's core died before the stream
sent anything (INTERNAL with the engine-dead trailer, service/failover.py), and never once a
token was relayed: that stream fails with the replica's INTERNAL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from bench.router_cluster import ProcessGroup, metric_value, scrape
from clients.client import build_request
from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from tests.router.round_robin import REPLICAS, RoundRobinCluster
from tests.service.serving import alive, core_of


class Cluster(RoundRobinCluster):
    def core(self, name: str) -> int:
        return core_of(self.group.procs[name].pid)

    def retries(self) -> float:
        return metric_value(scrape(self.metrics_port), "deja_router_retries_total")


@pytest.fixture
def cluster(tiny_llama_path: Path, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(ProcessGroup(tmp_path / "cluster"))
    serve_extra = ["--num-device-blocks", "512", "--max-num-seqs", "16", "--cpu-swap-gib", "0"]
    try:
        c.start(str(tiny_llama_path), serve_extra, healthy_timeout_s=300.0)
        yield c
    finally:
        c.group.stop_all()
        for proc in c.group.procs.values():  # an engine core whose server was killed exits itself
            proc.wait(timeout=30)


async def _active_streams(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as ch:
        load = await pb_grpc.InferenceStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5)
    return int(load.active_streams)


async def _holder(c: Cluster, call: asyncio.Task[object] | None = None) -> str | None:
    """The replica with an open Generate stream (polled through GetLoad on each replica); None
    when `call` finished first."""
    deadline = time.monotonic() + 30.0
    while True:
        for name in REPLICAS:
            if c.group.alive(name) and await _active_streams(c.target(name)) > 0:
                return name
        if call is not None and call.done():
            return None
        assert time.monotonic() < deadline, "no replica holds the stream"
        await asyncio.sleep(0.05)


def _request(max_tokens: int) -> pb.GenerateRequest:
    return build_request("Once upon a time", max_tokens=max_tokens, ignore_eos=True)


async def _collect(call: grpc.aio.UnaryStreamCall) -> list[pb.GenerateResponse]:
    return [msg async for msg in call]


async def test_stream_with_no_token_yet_is_retried_on_the_other_replica(
    cluster: Cluster,
) -> None:
    c = cluster
    frozen = c.core("r0")
    os.kill(frozen, signal.SIGSTOP)  # r0 takes the stream but yields no token
    try:
        async with grpc.aio.insecure_channel(c.target("router")) as ch:
            stub = pb_grpc.InferenceStub(ch)
            for _ in range(6):  # round robin: at most a few calls until one lands on r0
                task = asyncio.create_task(_collect(stub.Generate(_request(8), timeout=120)))
                if await _holder(c, task) == "r0":
                    break
                assert (await task)[-1].final.route.replica_id == "r1"
            else:
                pytest.fail("no call reached r0")
            assert not task.done()
            assert c.retries() == 0
            os.kill(frozen, signal.SIGKILL)
            msgs = await task
    finally:
        if alive(frozen):
            os.kill(frozen, signal.SIGKILL)
    final = msgs[-1].final
    assert final.route.replica_id == "r1"
    assert final.usage.completion_tokens == 8
    assert c.retries() == 1
    assert c.group.procs["r0"].wait(timeout=60) != 0  # the replica whose core died exits non-zero


async def test_stream_past_its_first_token_is_not_retried(cluster: Cluster) -> None:
    c = cluster
    async with grpc.aio.insecure_channel(c.target("router")) as ch:
        call = pb_grpc.InferenceStub(ch).Generate(_request(900), timeout=120)
        first = await call.read()
        assert isinstance(first, pb.GenerateResponse) and not first.HasField("final")
        holder = await _holder(c)
        assert holder is not None
        other = next(name for name in REPLICAS if name != holder)
        os.kill(c.core(holder), signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await call.read() is not grpc.aio.EOF:
                pass
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "engine" in (info.value.details() or "")
    assert c.retries() == 0
    assert await _active_streams(c.target(other)) == 0
    assert c.group.procs[holder].wait(timeout=60) != 0
