"""What the sync and asyncio clients share (`ClientBase`): options, call metadata (bearer token,
W3C trace context of a client span), deadlines and the retry policy (UNAVAILABLE, before the
first message only)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from clients.result import GenerateResult
from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc

DEFAULT_TARGET = "localhost:50051"
_PROPAGATOR = TraceContextTextMapPropagator()


def _is_retryable(err: grpc.RpcError) -> bool:
    if isinstance(err, grpc.Call | grpc.aio.AioRpcError):
        return err.code() == grpc.StatusCode.UNAVAILABLE
    return False


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how long apart a Generate call is retried (UNAVAILABLE only)."""

    retries: int = 3
    """Retries after the first attempt at most."""
    backoff_s: float = 0.2
    """Wait before the first retry; doubled before each later one."""

    def wait(self, attempt: int, deadline: float | None) -> float | None:
        """Seconds to wait before retry `attempt` (1-based), None when no retry is left."""
        if attempt > self.retries:
            return None
        wait = self.backoff_s * 2 ** (attempt - 1)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait


@dataclass(slots=True)
class _GenerateCall:
    """One Generate stream across its attempts: span, deadline, the call in flight, the result."""

    span: trace.Span
    deadline: float | None
    call: Any = None
    attempt: int = 0
    """Retries so far."""
    result: GenerateResult = field(default_factory=GenerateResult)
    t0: float = field(default_factory=time.monotonic)

    def add(self, msg: pb.GenerateResponse) -> None:
        self.result.add(msg, elapsed_s=time.monotonic() - self.t0)


class ClientBase:
    """What the sync and asyncio clients share: options, metadata, tracing, retry policy."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        timeout: float | None = None,
        retries: int = 3,
        retry_backoff_s: float = 0.2,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = RetryPolicy(retries, retry_backoff_s)
        self._token = token
        self._tracer = trace.get_tracer("deja.client", tracer_provider=tracer_provider)
        creds = grpc.ssl_channel_credentials(root_certificates) if tls else None
        self._channel = self._open_channel(target, creds)
        self.stub = pb_grpc.InferenceStub(self._channel)

    def _open_channel(self, target: str, creds: grpc.ChannelCredentials | None) -> Any:
        raise NotImplementedError

    def _unary(self, rpc: Any, req: Any) -> Any:
        """A unary call with the client's timeout and metadata (awaitable on the asyncio stub)."""
        return rpc(req, timeout=self.timeout, metadata=self._metadata())

    def _metadata(self, span: trace.Span | None = None) -> list[tuple[str, str]]:
        md: list[tuple[str, str]] = []
        if self._token:
            md.append(("authorization", f"Bearer {self._token}"))
        carrier: dict[str, str] = {}
        ctx = trace.set_span_in_context(span) if span is not None else None
        if span is not None and not span.get_span_context().is_valid:
            ctx = None  # tracing off here: pass on the caller's context, if any
        _PROPAGATOR.inject(carrier, context=ctx)
        md.extend(carrier.items())
        return md

    def _start_span(self, req: pb.GenerateRequest) -> trace.Span:
        attrs: dict[str, Any] = {
            "rpc.system": "grpc",
            "rpc.service": "deja.v1.Inference",
            "rpc.method": "Generate",
            "server.address": self.target,
        }
        if req.request_id:
            attrs["deja.request_id"] = req.request_id
        if req.session_id:
            attrs["deja.session_id"] = req.session_id
        return self._tracer.start_span(
            "deja.v1.Inference/Generate", kind=SpanKind.CLIENT, attributes=attrs
        )

    def _deadline(self, timeout: float | None) -> float | None:
        t = self.timeout if timeout is None else timeout
        return None if t is None else time.monotonic() + t

    @contextmanager
    def _generate_call(
        self, req: pb.GenerateRequest, timeout: float | None
    ) -> Iterator[_GenerateCall]:
        """One Generate stream's scope: on the way out an unfinished call is cancelled and the
        span ends (with the error, if any; leaving the stream early is not one)."""
        gen = _GenerateCall(self._start_span(req), self._deadline(timeout))
        err: BaseException | None = None
        try:
            yield gen
        except BaseException as e:
            err = e
            raise
        finally:
            if gen.call is not None and gen.result.final is None:
                gen.call.cancel()
            _end_span(gen.span, gen.result, None if isinstance(err, GeneratorExit) else err)

    def _attempt(self, req: pb.GenerateRequest, gen: _GenerateCall) -> Any:
        """Starts a (new) Generate call with the time left to the deadline."""
        gen.call = self.stub.Generate(
            req, timeout=_remaining(gen.deadline), metadata=self._metadata(gen.span)
        )
        return gen.call

    def _retry_wait(self, err: BaseException, gen: _GenerateCall) -> float | None:
        """Seconds to wait before retrying after `err` (before the first message), None: give up."""
        gen.attempt += 1
        return self.retry.wait(gen.attempt, gen.deadline) if _is_retryable(err) else None


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


def _end_span(span: trace.Span, result: GenerateResult | None, err: BaseException | None) -> None:
    if result is not None and result.final is not None:
        u = result.final.usage
        span.set_attribute("gen_ai.usage.input_tokens", u.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", u.completion_tokens)
    if isinstance(err, grpc.Call | grpc.aio.AioRpcError):
        span.set_status(Status(StatusCode.ERROR, f"{err.code().name}: {err.details()}"))
    elif err is not None:
        span.set_status(Status(StatusCode.ERROR, type(err).__name__))
    span.end()
