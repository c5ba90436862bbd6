"""A replica's engine core dies under open streams (fault injection; under
load): a real round-robin `deja route` in front of two `deja serve` replicas (tiny model), each a
separate process.

The router retries a stream on the other replica when the replica's core died before the stream
sent anything (UNAVAILABLE with the engine-dead trailer, service/common/failover.py), and never
once a token was relayed: that stream fails with the replica's UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from clients.client import build_request
from clients.testing.cluster import ProcessGroup, metric_sum, metric_value, scrape
from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from tests.router.round_robin import REPLICAS, RoundRobinCluster
from tests.service.serving import alive, core_of
from tests.support.waiting import wait_until


class Cluster(RoundRobinCluster):
    def core(self, name: str) -> int:
        return core_of(self.group.procs[name].pid)

    def retries(self) -> float:
        return metric_sum(scrape(self.metrics_port), "deja_router_retries_total")

    def healthy_replicas(self) -> float:
        text = scrape(self.metrics_port)
        return metric_value(text, "deja_router_replicas", 'state="healthy"')


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
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "engine" in (info.value.details() or "")
    assert c.retries() == 0
    assert await _active_streams(c.target(other)) == 0
    assert c.group.procs[holder].wait(timeout=60) != 0


@dataclass
class _Outcome:
    """One Generate through the router: its final message or its error, and how many messages
    it had received."""

    final: pb.Final | None = None
    error: grpc.aio.AioRpcError | None = None
    messages: int = 0


async def _run(
    stub: pb_grpc.InferenceStub, max_tokens: int, first: asyncio.Event | None = None
) -> _Outcome:
    out = _Outcome()
    try:
        async for msg in stub.Generate(_request(max_tokens), timeout=60):
            out.messages += 1
            if first is not None:
                first.set()
            if msg.HasField("final"):
                out.final = msg.final
    except grpc.aio.AioRpcError as e:
        out.error = e
    return out


async def _arrivals(
    stub: pb_grpc.InferenceStub, c: Cluster, into: list[asyncio.Task[_Outcome]]
) -> None:
    """New calls, one every 20 ms, until the router has seen r0 go and 10 more after that."""
    after = 10
    deadline = time.monotonic() + 30.0
    while after and time.monotonic() < deadline:
        into.append(asyncio.create_task(_run(stub, 8)))
        if after < 10 or await asyncio.to_thread(c.healthy_replicas) < len(REPLICAS):
            after -= 1
        await asyncio.sleep(0.02)  # pacing the load, not waiting for anything


@pytest.mark.parametrize("victim", ["engine_core", "replica"])
async def test_kill_under_load_fails_only_streams_that_had_output(
    cluster: Cluster, victim: str
) -> None:
    """Streams of the killed replica that had streamed a token fail with
    a clear error; every other call (queued there with no token yet, arriving during and after the
    kill) completes on the other replica."""
    c = cluster
    core = c.core("r0")
    arrived: list[asyncio.Task[_Outcome]] = []
    async with grpc.aio.insecure_channel(c.target("router")) as ch:
        stub = pb_grpc.InferenceStub(ch)
        started = [asyncio.Event() for _ in range(4)]
        mid_output = [asyncio.create_task(_run(stub, 1000, ev)) for ev in started]
        await wait_until(lambda: all(e.is_set() for e in started), 60, what="first tokens")
        os.kill(core, signal.SIGSTOP)  # r0's streams stay open; new ones there get no token
        try:
            had_output = await _active_streams(c.target("r0"))
            assert had_output >= 1  # round robin: 2 of the 4
            no_output = [asyncio.create_task(_run(stub, 8)) for _ in range(8)]

            async def settled() -> bool:  # each call is done (on r1) or held by frozen r0
                held = await _active_streams(c.target("r0")) - had_output
                return held + sum(t.done() for t in no_output) == len(no_output)

            await wait_until(settled, 30, what="calls held by r0")
            held = await _active_streams(c.target("r0")) - had_output
            assert held >= 1
            arrivals = asyncio.create_task(_arrivals(stub, c, arrived))
            await wait_until(lambda: len(arrived) >= 5, 30, what="arrivals under way")
            if victim == "engine_core":
                os.kill(core, signal.SIGKILL)
            else:
                c.group.procs["r0"].kill()
            await arrivals
            outcomes = await asyncio.gather(*mid_output, *no_output, *arrived)
        finally:
            if alive(core):
                os.kill(core, signal.SIGKILL)
    failed = [o for o in outcomes if o.error is not None]
    assert len(failed) == had_output, [str(o.error) for o in failed]
    for o in failed:  # only streams that had streamed fail, with the replica's error
        assert o.messages >= 1
        assert o.error is not None
        assert o.error.code() == grpc.StatusCode.UNAVAILABLE
        if victim == "engine_core":
            assert "engine" in (o.error.details() or "")
    for o in outcomes:
        if o.error is None:
            assert o.final is not None and o.final.usage.completion_tokens in (8, 1000)
    for o in (*(t.result() for t in no_output), *(t.result() for t in arrived)):
        assert o.error is None and o.final is not None
    assert c.retries() >= held
    assert c.group.procs["r0"].wait(timeout=60) != 0
