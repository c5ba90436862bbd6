"""Acceptance 4: each bad input gets the right status code and a message that says what to fix,
and leaves nothing behind (no open stream, no engine request, every block free)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from clients.client import AsyncDejaClient, build_request
from engine.frontend.async_engine import AsyncEngine
from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from service.replica import convert
from tests.service.conftest import Harness, StartServer, make_engine

INVALID = grpc.StatusCode.INVALID_ARGUMENT
AUTH = (("secret-a", "acme"), ("secret-b", "globex"))
OUTCOMES = {
    INVALID: "invalid_argument",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected_queue_full",
    grpc.StatusCode.UNAVAILABLE: "rejected_draining",
}
"""The deja_requests_total outcome each refusal is counted under."""


async def gen(h: Harness, **kwargs: Any) -> None:
    """One Generate call with the harness client (any error propagates)."""
    prompt = kwargs.pop("prompt", None)
    if prompt is None and "messages" not in kwargs and "req" not in kwargs:
        prompt = "Hello there"
    req = kwargs.pop("req", None) or build_request(prompt, **kwargs)
    async for _ in h.client.stream(req):
        pass


async def raw_bytes(h: Harness, method: str, data: bytes) -> None:
    """Sends bytes that are not a valid message through a generic channel (no stubs)."""
    async with grpc.aio.insecure_channel(h.target) as ch:
        call = ch.unary_stream(
            method, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )(data)
        async for _ in call:
            pass


async def as_user(h: Harness, metadata: list[tuple[str, str]], rpc: str = "Generate") -> None:
    async with grpc.aio.insecure_channel(h.target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        if rpc == "Generate":
            async for _ in stub.Generate(pb.GenerateRequest(text="Hi"), metadata=metadata):
                pass
        else:
            await getattr(stub, rpc)(pb.GetCacheStatsRequest(), metadata=metadata)


async def over_queue_limit(h: Harness) -> None:
    """max_num_seqs=1 and max_queued_requests=1: A runs, B waits, C is refused."""
    long = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.0}
    a = h.client.generate("Once upon a time", **long)
    await anext(a)  # A is running (it has a token), so it no longer counts as queued
    b = asyncio.create_task(h.client.complete("The quick brown fox", **long))
    t0 = time.monotonic()
    while h.replica.servicer.num_queued < 1:
        assert time.monotonic() - t0 < 5
        await asyncio.sleep(0.01)
    try:
        await h.client.complete("Third one", max_tokens=2)
    finally:
        await a.aclose()
        b.cancel()
        await asyncio.gather(b, return_exceptions=True)


async def while_draining(h: Harness) -> None:
    h.replica.servicer.draining = True
    try:
        await h.client.complete("Hello", max_tokens=2)
    finally:
        h.replica.servicer.draining = False


async def duplicate_request_id(h: Harness) -> None:
    a = h.client.generate("Once upon a time", request_id="dup", max_tokens=900, ignore_eos=True)
    await anext(a)
    try:
        await h.client.complete("Hello", request_id="dup", max_tokens=2)
    finally:
        await a.aclose()


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[Harness], Awaitable[None]]
    code: grpc.StatusCode
    message: str
    """A substring of the status details (lower-cased comparison)."""
    server: dict[str, Any] = field(default_factory=dict)
    token: str | None = None
    one_seq_engine: bool = False


def unauthenticated(
    name: str, metadata: list[tuple[str, str]], message: str, rpc: str = "Generate"
) -> Case:
    """A call with `metadata` to a server with auth on, refused as UNAUTHENTICATED."""
    return Case(
        name,
        lambda h: as_user(h, metadata, rpc=rpc),
        grpc.StatusCode.UNAUTHENTICATED,
        message,
        server={"auth_tokens": AUTH},
    )


def _ids(n: int) -> list[int]:
    return [5] * n


CASES = [
    Case("empty-text", lambda h: gen(h, prompt=""), INVALID, "prompt is empty"),
    Case("no-input", lambda h: gen(h, req=pb.GenerateRequest()), INVALID, "no input"),
    Case("empty-token-ids", lambda h: gen(h, prompt=[]), INVALID, "prompt is empty"),
    Case("too-long", lambda h: gen(h, prompt=_ids(1024)), INVALID, "max_model_len is 1024"),
    Case("token-id-over-vocab", lambda h: gen(h, prompt=[1, 600]), INVALID, "outside the vocab"),
    Case("negative-token-id", lambda h: gen(h, prompt=[1, -3]), INVALID, "token id -3"),
    Case("temperature<0", lambda h: gen(h, temperature=-1.0), INVALID, "temperature must be >= 0"),
    Case("temperature-nan", lambda h: gen(h, temperature=float("nan")), INVALID, "finite"),
    Case("top_p=0", lambda h: gen(h, top_p=0.0), INVALID, "top_p must be in (0, 1]"),
    Case("top_p>1", lambda h: gen(h, top_p=1.5), INVALID, "top_p"),
    Case("top_k<0", lambda h: gen(h, top_k=-5), INVALID, "top_k"),
    Case("min_p>1", lambda h: gen(h, min_p=2.0), INVALID, "min_p"),
    Case("n=0", lambda h: gen(h, n=0), INVALID, "n must be between 1 and"),
    Case("n-over-cap", lambda h: gen(h, n=1000), INVALID, "n must be between 1 and"),
    Case("max_tokens=0", lambda h: gen(h, max_tokens=0), INVALID, "max_tokens must be >= 1"),
    Case("min>max", lambda h: gen(h, max_tokens=2, min_tokens=5), INVALID, "min_tokens"),
    Case("presence", lambda h: gen(h, presence_penalty=3.0), INVALID, "presence_penalty"),
    Case("repetition=0", lambda h: gen(h, repetition_penalty=0.0), INVALID, "repetition"),
    Case("empty-stop", lambda h: gen(h, stop=[""]), INVALID, "stop strings must not be empty"),
    Case("stop-id", lambda h: gen(h, stop_token_ids=[99999]), INVALID, "stop token id 99999"),
    Case("logprobs-over-cap", lambda h: gen(h, logprobs=1000), INVALID, "logprobs must be"),
    Case("empty-chat", lambda h: gen(h, messages=[]), INVALID, "chat"),
    Case(
        "chat-no-role",
        lambda h: gen(h, messages=[{"role": "", "content": "hi"}]),
        INVALID,
        "no role",
    ),
    Case(
        "not-a-message",
        lambda h: raw_bytes(h, "/deja.v1.Inference/Generate", b"\xff\xff\xff\xff"),
        INVALID,
        "not a valid deja.v1.GenerateRequest",
    ),
    Case("duplicate-request-id", duplicate_request_id, INVALID, "already"),
    unauthenticated("auth-missing-token", [], "missing `authorization: bearer <token>`"),
    unauthenticated("auth-wrong-token", [("authorization", "Bearer nope")], "unknown bearer token"),
    unauthenticated(
        "auth-not-bearer", [("authorization", "Basic c2VjcmV0LWE=")], "must be `bearer <token>`"
    ),
    unauthenticated("auth-on-info-calls", [], "missing", rpc="GetCacheStats"),
    Case(
        "auth-ok-but-bad-input",
        lambda h: gen(h, prompt=""),
        INVALID,
        "prompt is empty",
        server={"auth_tokens": AUTH},
        token="secret-b",
    ),
    Case(
        "over-queue-limit",
        over_queue_limit,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "(limit 1)",
        server={"max_queued_requests": 1},
        one_seq_engine=True,
    ),
    Case("draining", while_draining, grpc.StatusCode.UNAVAILABLE, "draining"),
]


@pytest.fixture(scope="module")
def one_seq_engine(tiny_llama_path: Path) -> Any:
    eng = make_engine(tiny_llama_path, max_num_seqs=1)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_bad_input(case: Case, start_server: StartServer, request: Any) -> None:
    engine = request.getfixturevalue("one_seq_engine") if case.one_seq_engine else None
    h = await start_server(engine, token=case.token, **case.server)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(case.call(h), 30)
    err = info.value
    assert err.code() == case.code, err.details()
    assert case.message.lower() in (err.details() or "").lower(), err.details()
    if case.server.get("auth_tokens"):
        h.client = AsyncDejaClient(h.target, token="secret-a", retries=0)
    await h.assert_clean()
    outcome = OUTCOMES[case.code]
    counted = h.replica.metrics.registry.get_sample_value(
        "deja_requests_total", {"outcome": outcome}
    )
    assert counted is not None and counted >= 1


async def test_tokenize_bad_input(server: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await server.client.tokenize()
    assert info.value.code() == INVALID and "no input" in (info.value.details() or "")


async def test_stream_overflow_is_resource_exhausted(
    start_server: StartServer, tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader slower than the engine overflows the per-stream buffer: the request is aborted
    and freed, the step loop keeps going, the client gets RESOURCE_EXHAUSTED."""
    engine = make_engine(tiny_llama_path, stream_buffer=4)
    try:
        h = await start_server(engine)
        slow_delta = convert.choice_delta

        def slow(*args: Any, **kwargs: Any) -> pb.ChoiceDelta:
            time.sleep(0.05)  # blocks the event loop: the reader falls behind the step thread
            return slow_delta(*args, **kwargs)

        monkeypatch.setattr(convert, "choice_delta", slow)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.complete("Once upon a time", max_tokens=500, ignore_eos=True)
        monkeypatch.setattr(convert, "choice_delta", slow_delta)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too slowly" in (info.value.details() or "")
        await h.assert_clean()
        ok = await h.client.complete("Hello", max_tokens=3)
        assert ok.usage.completion_tokens == 3
    finally:
        engine.shutdown()


async def test_engine_failure_is_unavailable_and_not_serving(
    start_server: StartServer, tiny_llama_path: Path
) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    engine = make_engine(tiny_llama_path, in_process=True)
    assert isinstance(engine, AsyncEngine)
    try:
        h = await start_server(engine)

        def broken_step() -> Any:
            raise RuntimeError("simulated device failure")

        engine.engine.step = broken_step  # type: ignore[method-assign]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.client.complete("Hello", max_tokens=3)
        # the engine is dead: the replica cannot serve, the caller may go elsewhere
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "simulated device failure" in (info.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await h.client.complete("Hello", max_tokens=3)
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE  # new calls: go elsewhere
        assert "has failed" in (again.value.details() or "")
        async with grpc.aio.insecure_channel(h.target) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="deja.v1.Inference")
            )
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not h.replica.servicer.streams
    finally:
        engine.shutdown()
