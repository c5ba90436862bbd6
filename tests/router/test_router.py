"""The router in process, in front of scripted fake replicas: routing, proxying, degradation."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.affinity import AffinityConfig, AffinityStore
from service.affinity.memory import MemoryAffinityStore
from service.affinity.redis_store import RedisAffinityStore
from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from service.router.config import RouterConfig
from service.router.policy import OverloadGuard
from service.router.server import Router, serve_router
from tests.support.redis_proc import RedisProcess
from tests.support.waiting import wait_until

from .fake_replica import FakeReplica


@dataclass
class Setup:
    replicas: list[FakeReplica]
    router: Router
    stub: pb_grpc.InferenceStub
    exporter: InMemorySpanExporter


async def make_setup(
    store: AffinityStore | None = None, n: int = 3, **config: object
) -> AsyncIterator[Setup]:
    config.setdefault("policy", "affinity")  # these tests pin the affinity policy's rules
    replicas = [FakeReplica(f"r{i}") for i in range(n)]
    for r in replicas:
        await r.start()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    cfg = RouterConfig(
        port=0,
        replicas=tuple(r.address for r in replicas),
        poll_interval_s=0.1,
        poll_timeout_s=1.0,
        **config,  # type: ignore[arg-type]
    )
    router = await serve_router(cfg, store=store or MemoryAffinityStore(), tracer_provider=provider)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    try:
        yield Setup(replicas, router, pb_grpc.InferenceStub(channel), exporter)
    finally:
        await channel.close()
        await router.shutdown(0)
        for r in replicas:
            await r.stop()


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    async for s in make_setup():
        yield s


def prompt(session: int, turn: int) -> list[int]:
    """Turn k's prompt extends turn k-1's (a conversation), 8 tokens (2 blocks) per turn."""
    return [1000 * session + i for i in range(8 * (turn + 1))]


async def generate(
    stub: pb_grpc.InferenceStub,
    ids: list[int],
    session: str = "",
    request_id: str = "",
    **kw: object,
) -> pb.Final:
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), session_id=session, request_id=request_id
    )
    final = None
    async for resp in stub.Generate(req, **kw):
        if resp.HasField("final"):
            final = resp.final
    assert final is not None
    return final


async def test_session_affinity_and_route_info(setup: Setup) -> None:
    routes: dict[int, list[pb.Final]] = {}
    for turn in range(3):
        finals = await asyncio.gather(
            *(generate(setup.stub, prompt(s, turn), f"s{s}") for s in range(6))
        )
        for s, f in enumerate(finals):
            routes.setdefault(s, []).append(f)
    for finals in routes.values():
        assert finals[0].route.reason == "load"
        assert {f.replica_id for f in finals} == {finals[0].route.replica_id}
        assert [f.route.reason for f in finals[1:]] == ["session", "session"]
    # Concurrent new sessions are spread, not piled on one replica.
    first = Counter(f[0].replica_id for f in routes.values())
    assert len(first) == 3 and max(first.values()) <= 3


async def test_new_session_with_a_shared_prefix_goes_to_its_holder(setup: Setup) -> None:
    owner = (await generate(setup.stub, prompt(7, 3), "owner")).replica_id
    for i in range(3):
        ids = [*prompt(7, 2), 99, 98, 97, 96 + i]
        f = await generate(setup.stub, ids, f"new{i}")
        assert (f.replica_id, f.route.reason) == (owner, "prefix")


async def test_overloaded_session_replica_moves(setup: Setup) -> None:
    home = (await generate(setup.stub, prompt(1, 0), "hot")).replica_id
    fake = next(r for r in setup.replicas if r.replica_id == home)
    fake.waiting = 100
    handle = setup.router.pool.by_id(home)
    assert handle is not None
    await wait_until(lambda: handle.candidate().waiting == 100, what="a poll sees the queue")
    f = await generate(setup.stub, prompt(1, 1), "hot")
    assert f.replica_id != home and f.route.reason in ("load", "prefix")
    fake.waiting = 0


async def test_retry_on_unavailable_before_first_message(setup: Setup) -> None:
    for r in setup.replicas[:2]:
        r.fail_before_first = grpc.StatusCode.UNAVAILABLE
    for i in range(4):
        f = await generate(setup.stub, prompt(i, 0), f"u{i}")
        assert f.replica_id == "r2"
    registry = setup.router.metrics.registry
    retries = registry.get_sample_value("deja_router_retries_total", {"reason": "unavailable"})
    assert retries is not None and retries >= 1


async def test_errors_pass_through_without_retry(setup: Setup) -> None:
    for r in setup.replicas:
        r.fail_before_first = grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(setup.stub, prompt(0, 0), "bad")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "refuses" in (err.value.details() or "")
    assert sum(len(r.seen) for r in setup.replicas) == 1


async def test_deadline_metadata_and_trace_pass_through(setup: Setup) -> None:
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    md = (("x-tenant-note", "hello"), ("traceparent", traceparent))
    f = await generate(setup.stub, prompt(0, 0), "t", timeout=5.0, metadata=md)
    seen = next(r for r in setup.replicas if r.replica_id == f.replica_id).seen[-1]
    assert seen.metadata["x-tenant-note"] == "hello"
    assert seen.time_remaining is not None and 3.0 < seen.time_remaining <= 5.1
    (span,) = [s for s in setup.exporter.get_finished_spans() if s.name.startswith("route")]
    assert span.parent is not None and span.parent.span_id == int("b7ad6b7169203331", 16)
    assert span.context.trace_id == int("0af7651916cd43dd8448eb211c80319c", 16)
    # The replica's parent is the router span, in the caller's trace.
    assert seen.metadata["traceparent"].split("-")[1:3] == [
        "0af7651916cd43dd8448eb211c80319c",
        f"{span.context.span_id:016x}",
    ]
    assert span.attributes is not None
    assert span.attributes["deja.route.reason"] == f.route.reason
    assert span.attributes["deja.route.replica_id"] == f.replica_id


async def test_cancel_reaches_the_replica(setup: Setup) -> None:
    for r in setup.replicas:
        r.deltas, r.delay_s = 50, 0.05
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(0, 0)), request_id="c1")
    call = setup.stub.Generate(req)
    async for _ in call:
        break
    call.cancel()
    await wait_until(lambda: any("c1" in r.cancelled for r in setup.replicas))
    assert setup.router.servicer.inflight == 0


async def test_pending_counts_end_with_the_first_token_or_the_stream() -> None:
    # The cost policy reads the router's pending tokens and requests per replica: a stream
    # cancelled before its first token and a finished one both leave nothing behind.
    async for s in make_setup(policy="cost"):
        await _cancel_then_finish(s)


async def _cancel_then_finish(s: Setup) -> None:
    handles = s.router.pool.handles()
    for r in s.replicas:
        r.delay_s = 0.5
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(0, 0)), request_id="p1")
    call = s.stub.Generate(req)
    await wait_until(lambda: sum(h.pending_requests for h in handles) == 1)
    assert sum(h.pending_prefill_tokens for h in handles) == len(prompt(0, 0))
    call.cancel()
    await wait_until(lambda: all(h.pending_requests == 0 for h in handles))
    assert all(h.pending_prefill_tokens == 0 for h in handles)
    for r in s.replicas:
        r.delay_s = 0.0
    await generate(s.stub, prompt(1, 0), "p2")
    assert all(h.pending_requests == h.pending_prefill_tokens == 0 for h in handles)


async def test_replica_down_moves_its_sessions(setup: Setup) -> None:
    homes = {s: (await generate(setup.stub, prompt(s, 0), f"d{s}")).replica_id for s in range(6)}
    victim = setup.replicas[0]
    await victim.stop()  # no poll has noticed yet: the first call gets UNAVAILABLE and retries
    for s in range(6):
        f = await generate(setup.stub, prompt(s, 1), f"d{s}")
        assert f.replica_id != victim.replica_id
        if homes[s] != victim.replica_id:
            assert f.replica_id == homes[s] and f.route.reason == "session"


async def test_unary_calls(setup: Setup) -> None:
    await wait_until(lambda: len(setup.router.pool.healthy()) == 3, what="every replica polled")
    load = await setup.stub.GetLoad(pb.GetLoadRequest())
    assert load.replica_id == "router"
    stats = await setup.stub.GetCacheStats(pb.GetCacheStatsRequest())
    assert (stats.prefix_queries, stats.prefix_hits) == (30, 12)
    assert [(t.name, t.num_blocks, t.used_blocks) for t in stats.tiers] == [("device", 24, 6)]
    aborted = await setup.stub.Abort(pb.AbortRequest(request_ids=["r1-x", "zz", "r2-y"]))
    assert sorted(aborted.aborted) == ["r1-x", "r2-y"]
    tok = await setup.stub.Tokenize(pb.TokenizeRequest(text="ab"))
    assert list(tok.token_ids) == [97, 98]
    info = await setup.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_id == "fake-model"


async def test_round_robin_ignores_sessions() -> None:
    async for s in make_setup(policy="round_robin"):
        finals = [await generate(s.stub, prompt(0, t), "same") for t in range(6)]
        assert Counter(f.replica_id for f in finals) == {"r0": 2, "r1": 2, "r2": 2}
        assert {f.route.reason for f in finals} == {"round_robin"}


async def test_overload_guard_inflight() -> None:
    async for s in make_setup(guard=OverloadGuard(max_inflight=1)):
        for r in s.replicas:
            r.deltas, r.delay_s = 5, 0.1
        finals = await asyncio.gather(*(generate(s.stub, prompt(0, t), "hot") for t in range(3)))
        assert len({f.replica_id for f in finals}) >= 2


async def test_redis_down_falls_back_and_recovers(redis_proc: RedisProcess) -> None:
    affinity = AffinityConfig(redis_url=redis_proc.url, reconnect_interval_s=0.1)
    store = RedisAffinityStore(redis_proc.url, op_timeout_s=0.3, reconnect_interval_s=0.1)
    async for s in make_setup(store=store, affinity=affinity, discover=False):
        homes = {i: (await generate(s.stub, prompt(i, 0), f"f{i}")).replica_id for i in range(6)}
        redis_proc.stop()
        reasons: Counter[str] = Counter()
        for turn in (1, 2):
            for i in range(6):
                f = await generate(s.stub, prompt(i, turn), f"f{i}")
                reasons[f.route.reason] += 1
        assert reasons["fallback"] >= 11  # the first failing call may still say "session"
        fallback = s.router.metrics.registry.get_sample_value("deja_router_fallback_total")
        assert fallback is not None and fallback >= 11

        redis_proc.start()
        await wait_until(lambda: store.available, what="the store reconnects")
        # The fresh Redis is empty: one turn re-records (by load), then affinity is back.
        after = {i: await generate(s.stub, prompt(i, 3), f"f{i}") for i in range(6)}
        again = {i: await generate(s.stub, prompt(i, 4), f"f{i}") for i in range(6)}
        for i in range(6):
            assert again[i].route.reason == "session"
            assert again[i].replica_id == after[i].replica_id
        assert set(homes) == set(range(6))
