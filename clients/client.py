"""Python client of the deja.v1 API, sync (`DejaClient`) and asyncio (`AsyncDejaClient`).

    with DejaClient("localhost:50051") as client:
        for delta in client.generate("Hello", max_tokens=32, temperature=0):
            print(delta.choices[0].text if delta.choices else "", end="")
        result = client.complete(messages=[{"role": "user", "content": "Hi"}])

`generate` streams GenerateResponse messages; `complete` collects them into a GenerateResult.
Both take a deadline (`timeout`, seconds), retry on UNAVAILABLE only before the first message
(nothing was generated yet), inject the W3C trace context of a client span into the call
metadata, and send `authorization: Bearer <token>` when a token is set. Leaving the stream early
cancels the call (the server aborts the request and frees its blocks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from service.common.flags import add_bool_flag, add_flag

DEFAULT_TARGET = "localhost:50051"
FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}
_SAMPLING_FIELDS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)
_PROPAGATOR = TraceContextTextMapPropagator()


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    request_id: str = "",
    session_id: str = "",
    cache_salt: str = "",
    pin_ttl_s: float = 0.0,
    return_token_ids: bool = False,
    logprobs: int | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest; `sampling` takes the SamplingParams fields (max_tokens=..., stop=[...]).

    Give exactly one of a text prompt, a list of token ids, or chat `messages`.
    """
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(
            f"unknown sampling fields {sorted(unknown)}; known: {sorted(_SAMPLING_FIELDS)}"
        )
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt (text or token ids) and messages")
    _response_format_fields(sampling)
    req = pb.GenerateRequest(
        request_id=request_id,
        session_id=session_id,
        cache_salt=cache_salt,
        pin_ttl_s=pin_ttl_s,
        return_token_ids=return_token_ids,
        sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
    )
    if logprobs is not None:
        req.logprobs = logprobs
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(prompt)
    else:
        assert messages is not None
        req.chat.messages.extend(
            pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages
        )
    return req


def _response_format_fields(sampling: dict[str, Any]) -> None:
    """Turns the structured-output shorthands into proto fields, in place: json_schema may be a
    dict or a pydantic model class (sent as JSON text), choice a list of strings."""
    schema = sampling.get("json_schema")
    if schema is not None and not isinstance(schema, str):
        to_schema = getattr(schema, "model_json_schema", None)
        sampling["json_schema"] = json.dumps(schema if to_schema is None else to_schema())
    choice = sampling.get("choice")
    if choice is not None and not isinstance(choice, pb.Choices):
        sampling["choice"] = pb.Choices(choices=list(choice))
    if sampling.get("json_object") is False:
        del sampling["json_object"]


def _schema_model(kwargs: dict[str, Any]) -> Any:
    """The pydantic model class given as json_schema, if any (to parse the reply with)."""
    schema = kwargs.get("json_schema")
    return schema if isinstance(schema, type) else None


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    """stop, length, abort or error."""
    stop_reason: int | str | None = None


@dataclass(slots=True)
class GenerateResult:
    """A whole Generate stream, collected."""

    request_id: str = ""
    choices: list[Choice] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    final: pb.Final | None = None
    """Usage, timings, replica id, route (None if the stream ended without one)."""
    num_messages: int = 0
    ttft_s: float | None = None
    """Client-side: from the call to the first message carrying a token (text, token ids or
    logprobs; ask for return_token_ids to see a token whose text is still held back). None when
    no token came."""
    total_s: float = 0.0
    response_model: Any = None
    """The pydantic model class given as json_schema (complete() sets it); parse() builds it."""

    def parse(self, index: int = 0) -> Any:
        """A choice's text parsed as JSON: an instance of `response_model` when one was given,
        else the plain JSON value. Raises ValueError when the choice did not finish with "stop"
        (a `length` finish holds partial JSON)."""
        c = self.choices[index]
        if c.finish_reason != "stop":
            raise ValueError(f"choice {index} ended with {c.finish_reason!r}; its JSON is partial")
        if self.response_model is not None:
            return self.response_model.model_validate_json(c.text)
        return json.loads(c.text)

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids if self.choices else []

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def usage(self) -> pb.Usage:
        return self.final.usage if self.final is not None else pb.Usage()

    @property
    def timings(self) -> pb.Timings:
        return self.final.timings if self.final is not None else pb.Timings()

    def add(self, msg: pb.GenerateResponse, *, elapsed_s: float) -> None:
        self.request_id = msg.request_id
        self.num_messages += 1
        self.prompt_token_ids.extend(msg.prompt_token_ids)
        for d in msg.choices:
            while len(self.choices) <= d.index:
                self.choices.append(Choice(index=len(self.choices)))
            c = self.choices[d.index]
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            c.logprobs.extend(d.logprobs)
            if d.finish_reason:
                c.finish_reason = FINISH_REASONS[d.finish_reason]
            which = d.WhichOneof("stop_reason")
            if which is not None:
                c.stop_reason = getattr(d, which)
            if self.ttft_s is None and (d.text or d.token_ids or d.logprobs):
                self.ttft_s = elapsed_s
        if msg.HasField("final"):
            self.final = msg.final
            for end in msg.final.choices:
                while len(self.choices) <= end.index:
                    self.choices.append(Choice(index=len(self.choices)))
                self.choices[end.index].finish_reason = FINISH_REASONS[end.finish_reason]
        self.total_s = elapsed_s


def _collector(
    kwargs: dict[str, Any],
) -> tuple[GenerateResult, Callable[[pb.GenerateResponse], None]]:
    """What `complete` returns, and the function that adds each streamed message to it."""
    result = GenerateResult(response_model=_schema_model(kwargs))
    t0 = time.monotonic()
    return result, lambda msg: result.add(msg, elapsed_s=time.monotonic() - t0)


def _is_retryable(err: grpc.RpcError) -> bool:
    if isinstance(err, grpc.Call | grpc.aio.AioRpcError):
        return err.code() == grpc.StatusCode.UNAVAILABLE
    return False


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


class _Base:
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
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
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

    def _backoff(self, attempt: int, deadline: float | None) -> float | None:
        """Seconds to wait before retry `attempt` (1-based), None when no retry is left."""
        if attempt > self.retries:
            return None
        wait = self.retry_backoff_s * 2 ** (attempt - 1)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait

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
        return self._backoff(gen.attempt, gen.deadline) if _is_retryable(err) else None


def _tokenize_request(
    text: str | None, messages: Sequence[dict[str, str]] | None
) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest()
    if text is not None:
        req.text = text
    if messages is not None:
        req.chat.messages.extend(pb.ChatMessage(**m) for m in messages)
    return req


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


class DejaClient(_Base):
    """Blocking client; one channel per instance (close it, or use `with`)."""

    _channel: grpc.Channel

    def _open_channel(self, target: str, creds: grpc.ChannelCredentials | None) -> grpc.Channel:
        if creds is not None:
            return grpc.secure_channel(target, creds)
        return grpc.insecure_channel(target)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DejaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Generator[pb.GenerateResponse, None, None]:
        """Streams the response messages (see build_request for the arguments)."""
        return self.stream(build_request(prompt, **kwargs), timeout=timeout)

    def stream(
        self, req: pb.GenerateRequest, *, timeout: float | None = None
    ) -> Generator[pb.GenerateResponse, None, None]:
        with self._generate_call(req, timeout) as gen:
            while True:
                call = self._attempt(req, gen)
                try:
                    first = next(call)
                    break
                except StopIteration:
                    return
                except grpc.RpcError as e:
                    wait = self._retry_wait(e, gen)
                    if wait is None:
                        raise
                    time.sleep(wait)
            gen.add(first)
            yield first
            for msg in call:
                gen.add(msg)
                yield msg

    def complete(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> GenerateResult:
        """Runs one request to the end and returns it collected (`.parse()` reads JSON output)."""
        result, add = _collector(kwargs)
        for msg in self.generate(prompt, timeout=timeout, **kwargs):
            add(msg)
        return result

    def tokenize(
        self, text: str | None = None, *, messages: Sequence[dict[str, str]] | None = None
    ) -> list[int]:
        resp = self._unary(self.stub.Tokenize, _tokenize_request(text, messages))
        return list(resp.token_ids)

    def model_info(self) -> pb.ModelInfo:
        return self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest())

    def load(self) -> pb.Load:
        return self._unary(self.stub.GetLoad, pb.GetLoadRequest())

    def cache_stats(self) -> pb.CacheStats:
        return self._unary(self.stub.GetCacheStats, pb.GetCacheStatsRequest())

    def abort(self, *request_ids: str) -> list[str]:
        resp = self._unary(self.stub.Abort, pb.AbortRequest(request_ids=request_ids))
        return list(resp.aborted)


class AsyncDejaClient(_Base):
    """asyncio client (grpc.aio); create it inside the event loop that uses it."""

    _channel: grpc.aio.Channel

    def _open_channel(self, target: str, creds: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
        if creds is not None:
            return grpc.aio.secure_channel(target, creds)
        return grpc.aio.insecure_channel(target)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncDejaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Streams the response messages (see build_request for the arguments)."""
        return self.stream(build_request(prompt, **kwargs), timeout=timeout)

    async def stream(
        self, req: pb.GenerateRequest, *, timeout: float | None = None
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        with self._generate_call(req, timeout) as gen:
            while True:
                call = self._attempt(req, gen)
                try:
                    msg = await call.read()
                    break
                except grpc.aio.AioRpcError as e:
                    wait = self._retry_wait(e, gen)
                    if wait is None:
                        raise
                    await asyncio.sleep(wait)
            while msg is not grpc.aio.EOF:
                gen.add(msg)
                yield msg
                msg = await call.read()

    async def complete(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> GenerateResult:
        result, add = _collector(kwargs)
        async for msg in self.generate(prompt, timeout=timeout, **kwargs):
            add(msg)
        return result

    async def tokenize(
        self, text: str | None = None, *, messages: Sequence[dict[str, str]] | None = None
    ) -> list[int]:
        resp = await self._unary(self.stub.Tokenize, _tokenize_request(text, messages))
        return list(resp.token_ids)

    async def model_info(self) -> pb.ModelInfo:
        return await self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest())

    async def load(self) -> pb.Load:
        return await self._unary(self.stub.GetLoad, pb.GetLoadRequest())

    async def cache_stats(self) -> pb.CacheStats:
        return await self._unary(self.stub.GetCacheStats, pb.GetCacheStatsRequest())

    async def abort(self, *request_ids: str) -> list[str]:
        resp = await self._unary(self.stub.Abort, pb.AbortRequest(request_ids=request_ids))
        return list(resp.aborted)

    async def kv_events(
        self, start_sequence_number: int = 0, *, timeout: float | None = None
    ) -> AsyncGenerator[pb.KvEventBatch, None]:
        """The replica's KV-event batches from `start_sequence_number` on (0: a snapshot first),
        until the server ends the stream or `timeout` passes; leaving the loop cancels the call.
        To resume after a break, pass the last sequence_number received + 1."""
        call = self.stub.SubscribeKvEvents(
            pb.SubscribeKvEventsRequest(start_sequence_number=start_sequence_number),
            timeout=timeout,
            metadata=self._metadata(),
        )
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()


# -- command-line helpers ------------------------------------------------------------------------


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """--target, --token, --tls, --tls-ca, --timeout (each also a DEJA_* variable)."""
    g = parser.add_argument_group("connection")
    add_flag(g, "--target", default=DEFAULT_TARGET, help="Server address host:port.")
    add_flag(g, "--token", help="Bearer token (when the server has auth on).")
    add_bool_flag(g, "--tls", default=False, help="Connect with TLS.")
    add_flag(g, "--tls-ca", help="PEM root certificates for TLS (default: system roots).")
    add_flag(g, "--timeout", type=float, help="Deadline per call in seconds.")


def client_from_args(args: argparse.Namespace) -> DejaClient:
    roots = None
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            roots = f.read()
    return DejaClient(
        args.target, token=args.token, tls=args.tls, root_certificates=roots, timeout=args.timeout
    )


__all__ = [
    "AsyncDejaClient",
    "DejaClient",
    "GenerateResult",
    "build_request",
]
