"""Property-based fuzzing of Generate against a real replica: arbitrary requests (every field,
extreme values, huge repeated fields, invalid UTF-8 sent as raw bytes) end OK, INVALID_ARGUMENT
or RESOURCE_EXHAUSTED — never INTERNAL or UNKNOWN — the replica stays SERVING and no block
leaks. Examples are bounded so the module runs in well under a minute."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from service.replica.config import ServiceConfig
from service.replica.server import Replica, serve
from tests.service.conftest import Engine

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
GENERATE = "/deja.v1.Inference/Generate"
MARK = b"\x01FUZZ\x01"
"""Stands in for a string field; replaced in the serialized bytes by invalid UTF-8 of the same
length (so every length prefix stays right)."""
BAD_UTF8 = (
    b"\xff\xfe\x80\xc3(\xed\xa0",
    b"\xc0\xaf\xe0\x80\xaf\xf8\x88",
    b"ok\xf0\x28\x8c\xbc\x00",
)

INT32 = st.integers(-(2**31), 2**31 - 1)
EXTREME_INT = st.sampled_from([-(2**31), -1, 0, 1, 2, 7, 1024, 2**31 - 1])
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 0.5, 1.0, 2.0, -2.0, 1e300, float("nan")]),
)
TEXT = st.text(max_size=64)


@dataclass
class Live:
    replica: Replica
    engine: Engine
    loop: asyncio.AbstractEventLoop
    channel: grpc.Channel

    @property
    def stub(self) -> pb_grpc.InferenceStub:
        return pb_grpc.InferenceStub(self.channel)


@pytest.fixture(scope="module")
def live(engine: Engine) -> Iterator[Live]:
    """A replica on its own event loop thread, so hypothesis drives it with a blocking client."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzz-server", daemon=True)
    thread.start()
    config = ServiceConfig(port=0, grace_period_s=1.0, max_queued_requests=64)
    replica = asyncio.run_coroutine_threadsafe(
        serve(config, engine, monitor_interval_s=0.05), loop
    ).result(60)
    channel = grpc.insecure_channel(f"127.0.0.1:{replica.port}")
    try:
        yield Live(replica, engine, loop, channel)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(replica.shutdown(0.0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


@st.composite
def sampling_params(draw: st.DrawFn) -> pb.SamplingParams:
    fields: dict[str, Any] = {
        "n": draw(_optional(st.one_of(st.integers(-2, 4), EXTREME_INT))),
        "temperature": draw(_optional(FLOATS)),
        "top_p": draw(_optional(FLOATS)),
        "top_k": draw(st.one_of(st.integers(-2, 600), EXTREME_INT)),
        "min_p": draw(FLOATS),
        "repetition_penalty": draw(_optional(FLOATS)),
        "presence_penalty": draw(FLOATS),
        "frequency_penalty": draw(FLOATS),
        "seed": draw(_optional(st.integers(-(2**63), 2**63 - 1))),
        # Mostly short answers (bounded run time); sometimes the extremes.
        "max_tokens": draw(_optional(st.one_of(st.integers(-2, 8), EXTREME_INT))),
        "min_tokens": draw(st.one_of(st.integers(-2, 8), EXTREME_INT)),
        "stop": draw(st.lists(st.text(max_size=12), max_size=4)),
        "stop_token_ids": draw(st.lists(INT32, max_size=6)),
        "ignore_eos": draw(st.booleans()),
        "skip_special_tokens": draw(_optional(st.booleans())),
    }
    return pb.SamplingParams(**{k: v for k, v in fields.items() if v is not None})


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), TEXT)),
        session_id=draw(TEXT),
        cache_salt=draw(TEXT),
        pin_ttl_s=draw(st.one_of(FLOATS, st.sampled_from([0.0, 0.05]))),
        return_token_ids=draw(st.booleans()),
        sampling=draw(sampling_params()),
    )
    logprobs = draw(_optional(st.one_of(st.integers(-1, 6), EXTREME_INT)))
    if logprobs is not None:
        req.logprobs = logprobs
    which = draw(st.sampled_from(["text", "token_ids", "chat", "none"]))
    if which == "text":
        req.text = draw(st.text(max_size=300))
    elif which == "token_ids":
        ids = draw(
            st.one_of(
                st.lists(st.integers(0, 511), max_size=200),
                st.lists(st.one_of(INT32, st.integers(-3, 600)), max_size=20),
            )
        )
        req.token_ids.ids.extend(ids)
    elif which == "chat":
        for _ in range(draw(st.integers(0, 3))):
            role = draw(st.one_of(st.sampled_from(["system", "user", "assistant"]), TEXT))
            req.chat.messages.add(role=role, content=draw(st.text(max_size=100)))
    return req


def _call(live: Live, payload: bytes, timeout: float = 30.0) -> grpc.StatusCode:
    """Sends raw request bytes to Generate and reads the stream to its end."""
    call = live.channel.unary_stream(
        GENERATE,
        request_serializer=None,
        response_deserializer=pb.GenerateResponse.FromString,
        _registered_method=False,
    )
    try:
        for _ in call(payload, timeout=timeout):
            pass
    except grpc.RpcError as e:
        return e.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


def _assert_healthy_and_clean(live: Live, timeout: float = 10.0) -> None:
    health = health_pb2_grpc.HealthStub(live.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="deja.v1.Inference"), timeout=5)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + timeout
    while True:
        stats = live.stub.GetCacheStats(pb.GetCacheStatsRequest(), timeout=5)
        idle = not live.replica.servicer.streams
        if idle and stats.free_device_blocks == stats.total_device_blocks:
            return
        assert time.monotonic() < deadline, (
            f"{stats.total_device_blocks - stats.free_device_blocks} device blocks or "
            f"{len(live.replica.servicer.streams)} streams still held"
        )
        time.sleep(0.05)


FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


@FUZZ
@given(req=generate_requests())
def test_arbitrary_requests_never_fail_internally(live: Live, req: pb.GenerateRequest) -> None:
    code = _call(live, req.SerializeToString())
    assert code in ALLOWED, (code, req)


@settings(FUZZ, max_examples=25)
@given(
    req=generate_requests(),
    where=st.sampled_from(["request_id", "text", "stop", "role", "content", "cache_salt"]),
    bad=st.sampled_from(BAD_UTF8),
)
def test_invalid_utf8_in_any_string_is_invalid_argument(
    live: Live, req: pb.GenerateRequest, where: str, bad: bytes
) -> None:
    marker = MARK.decode()
    if where == "request_id":
        req.request_id = marker
    elif where == "text":
        req.text = marker
    elif where == "stop":
        req.sampling.stop.append(marker)
    elif where == "cache_salt":
        req.cache_salt = marker
    else:
        req.chat.messages.add(role="user", content="hi")
        setattr(req.chat.messages[-1], where, marker)
    payload = req.SerializeToString()
    assert payload.count(MARK) == 1
    assert _call(live, payload.replace(MARK, bad)) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda r: r.token_ids.ids.extend([5] * 200_000), id="200k-token-ids"),
        pytest.param(lambda r: r.token_ids.ids.extend([7] * 2_000_000), id="2M-token-ids"),
        pytest.param(
            lambda r: (r.token_ids.ids.append(5), r.sampling.stop_token_ids.extend(range(100_000))),
            id="100k-stop-ids",
        ),
        pytest.param(
            lambda r: (r.token_ids.ids.append(5), r.sampling.stop.extend(["x" * 100] * 20_000)),
            id="20k-stop-strings",
        ),
        pytest.param(lambda r: setattr(r, "text", "word " * 400_000), id="2MB-text"),
        pytest.param(
            lambda r: r.chat.messages.extend(
                pb.ChatMessage(role="user", content="hi") for _ in range(50_000)
            ),
            id="50k-chat-messages",
        ),
    ],
)
def test_huge_repeated_fields(live: Live, build: Any) -> None:
    """Over max_model_len or the 4 MB message limit: refused; else served (20k stop strings)."""
    req = pb.GenerateRequest()
    req.sampling.max_tokens = 2
    build(req)
    code = _call(live, req.SerializeToString(), timeout=60)
    assert code in ALLOWED, code


def test_still_serving_and_nothing_leaked(live: Live) -> None:
    """Runs after the fuzz tests above (same module replica)."""
    _assert_healthy_and_clean(live)
