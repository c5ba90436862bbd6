"""The credential-adding proxy (service/gateway/worker_proxy.py) in front of a real replica on the
tiny Llama that requires a bearer token: VllmEngine calls through it carry the token's tenant and
the caller's trace context; cancellation, status codes and details pass through unchanged."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine.frontend.prompt import prompt_block_hashes
from service.gateway.worker_proxy import channel_credentials, start_proxy
from tests.service.certs import make_pki
from tests.service.conftest import Harness, StartServer
from tests.support.waiting import wait_until

TOKEN, TENANT = "worker-secret", "gateway"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def request(prompt: list[int], **sampling: Any) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="p1",
        tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(**sampling),  # type: ignore[arg-type]
        stream=True,
    )


class Setup:
    def __init__(self, h: Harness, proxy: vpb_grpc.VllmEngineStub, spans: InMemorySpanExporter):
        self.h, self.proxy, self.spans = h, proxy, spans


@pytest.fixture
async def setup(start_server: StartServer) -> AsyncIterator[Setup]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    h = await start_server(auth_tokens=((TOKEN, TENANT),), token=TOKEN, tracer_provider=provider)
    server, port, upstream = await start_proxy(h.target, token=TOKEN)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield Setup(h, vpb_grpc.VllmEngineStub(ch), spans)
    finally:
        await server.stop(0)
        await upstream.close()


async def test_generate_and_info_through_the_proxy_carry_the_tenant(setup: Setup) -> None:
    h = setup.h
    info = await setup.proxy.GetModelInfo(vpb.GetModelInfoRequest())
    assert info.served_model_name == h.engine.model_info.model_id
    fresh = list(range(250, 290))
    md = (("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),)
    out = [r async for r in setup.proxy.Generate(request(fresh, max_tokens=4), metadata=md)]
    assert sum(len(r.chunk.token_ids) for r in out if r.HasField("chunk")) == 4
    assert out[-1].complete.finish_reason in ("length", "stop")
    # The engine salted the prompt's blocks with the token's tenant: the proxy added the token.
    model = h.engine.model_info.model_id
    cached = set(await h.engine.cached_block_hashes(100_000))
    assert set(prompt_block_hashes(fresh, 16, model, f"tenant:{TENANT}")) <= cached
    # The caller's trace context went upstream with it.
    await wait_until(lambda: bool(setup.spans.get_finished_spans()), 5, what="the replica's span")
    assert any(
        format(s.context.trace_id, "032x") == TRACE_ID for s in setup.spans.get_finished_spans()
    )


async def test_a_direct_call_without_the_token_is_unauthenticated(setup: Setup) -> None:
    async with grpc.aio.insecure_channel(setup.h.target) as ch:
        stub = vpb_grpc.VllmEngineStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetModelInfo(vpb.GetModelInfoRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [r async for r in stub.Generate(request([1, 2, 3], max_tokens=2))]
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_cancelling_through_the_proxy_aborts_the_replicas_request(setup: Setup) -> None:
    h = setup.h

    def cancelled() -> float:
        v = h.replica.metrics.registry.get_sample_value(
            "deja_requests_total", {"outcome": "cancelled"}
        )
        return v or 0.0

    before = cancelled()
    call = setup.proxy.Generate(
        request(list(range(350, 390)), temperature=0.0, max_tokens=900, ignore_eos=True)
    )
    first = await call.read()
    assert first.HasField("chunk")
    assert h.replica.servicer.streams  # running on the replica
    call.cancel()
    await h.assert_clean(timeout=5.0)
    await wait_until(lambda: cancelled() == before + 1, 5, what="the cancelled outcome")


async def test_upstream_status_and_details_come_through(setup: Setup) -> None:
    bad = request([1, 2, 3], top_p=1.5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [r async for r in setup.proxy.Generate(bad)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await setup.proxy.Embed(vpb.EmbedRequest())
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # A deadline goes upstream: a long generation ends DEADLINE_EXCEEDED, the replica cleans up.
    # (900 tokens take 900 steps: over 0.25 s at the tiny model's fastest step seen, 0.28 ms.)
    long = request(list(range(450, 490)), temperature=0.0, max_tokens=900, ignore_eos=True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [r async for r in setup.proxy.Generate(long, timeout=0.1)]
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await setup.h.assert_clean(timeout=5.0)


async def test_mtls_to_the_replica(start_server: StartServer, tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    h = await start_server(
        auth_tokens=((TOKEN, TENANT),),
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        tls_client_ca=str(pki.ca),
    )
    creds = channel_credentials(str(pki.ca), str(pki.client_cert), str(pki.client_key))
    server, port, upstream = await start_proxy(h.target, token=TOKEN, credentials=creds)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = vpb_grpc.VllmEngineStub(ch)
            assert (await stub.HealthCheck(vpb.HealthCheckRequest())).healthy
            out = [r async for r in stub.Generate(request([5, 6, 7], max_tokens=2))]
            assert out[-1].HasField("complete")
    finally:
        await server.stop(0)
        await upstream.close()
    # Without the client certificate the replica refuses the proxy: UNAVAILABLE comes through.
    no_cert = channel_credentials(str(pki.ca))
    server, port, upstream = await start_proxy(h.target, token=TOKEN, credentials=no_cert)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await vpb_grpc.VllmEngineStub(ch).GetModelInfo(vpb.GetModelInfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
        await upstream.close()
