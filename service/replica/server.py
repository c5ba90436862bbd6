"""The replica: a grpc.aio server over the AsyncEngine.

The servicer only translates between deja.v1 messages and engine types (service/replica/convert.py) and
maps failures to status codes:

    bad input (engine ValueError, undecodable message)   INVALID_ARGUMENT, the engine's message
    missing / unknown bearer token (auth on)              UNAUTHENTICATED
    more than max_queued_requests waiting for a token    RESOURCE_EXHAUSTED
    per-stream buffer overflow (slow reader)             RESOURCE_EXHAUSTED (request aborted)
    draining                                             UNAVAILABLE
    engine failure                                       INTERNAL, health turns NOT_SERVING
    engine core died under an open stream                INTERNAL + trailer (common/failover.py)

SubscribeKvEvents streams the engine's KV events from the replica's ring
(service/replica/kv_events.py) under the same auth rules; with auth on, stores carry no token ids.

A cancelled call or a passed deadline aborts the engine request (and frees its blocks) within one
engine step: leaving the engine's output generator aborts it, and a done-callback on the call
aborts it too in case the handler is cancelled while gRPC is writing.

`serve(config, engine)` builds and starts the server (health, optional reflection, optional
metrics endpoint) and returns a `Replica`; `Replica.shutdown()` drains it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span

from engine.errors import EngineDeadError, StreamOverflowError
from engine.kv.events import KVEventBatch, KVSnapshot
from engine.outputs import RequestOutput
from engine.sample.sampling_params import SamplingParams
from engine.stats import EngineStats, ModelInfo
from service.api.deja.v1 import inference_pb2 as pb
from service.common.auth import Auth, Unauthenticated, derive_cache_salt
from service.common.failover import engine_dead_trailer
from service.common.rpc import SERVICE_NAME, abort
from service.common.tracing import end_request_span, extract_context, get_tracer, start_request_span
from service.replica import convert
from service.replica.config import ServiceConfig
from service.replica.kv_events import KvEventRing
from service.replica.metrics import ServiceMetrics

log = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Engine(Protocol):
    """What the server needs from an engine: engine.frontend.core_client.EngineCoreClient (the engine core
    in its own process) or engine.frontend.async_engine.AsyncEngine (the step loop in a thread)."""

    @property
    def model_info(self) -> ModelInfo: ...

    def generate(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        messages: list[dict[str, str]] | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def get_stats(self) -> EngineStats: ...

    def tokenize(
        self, text: str | None = None, messages: list[dict[str, str]] | None = None
    ) -> list[int]: ...

    def check_health(self) -> None: ...

    @property
    def errored(self) -> bool: ...

    def shutdown(self, flush_timeout_s: float | None = None) -> None: ...

    async def cached_block_hashes(self, limit: int) -> list[bytes]: ...

    async def kv_snapshot(self) -> KVSnapshot: ...

    def set_kv_event_sink(self, sink: Callable[[KVEventBatch], None] | None) -> None: ...


@dataclass(slots=True)
class _Stream:
    """One open Generate call."""

    engine_id: str
    client_id: str
    tenant: str | None
    queued: bool = True
    """Admitted but no output yet (what admission control counts)."""
    done: bool = False


@dataclass(slots=True)
class _StreamRecord:
    """One Generate call as it runs: what it streamed, how it ended, its span."""

    request: pb.GenerateRequest
    stream: _Stream
    salt: str | None
    """The cache salt the engine hashes with (also what the replica agent records)."""
    span: Span
    outputs: AsyncIterator[RequestOutput]
    """The engine's deltas for this request."""
    tally: convert.StreamTally = field(default_factory=convert.StreamTally)
    last: RequestOutput | None = None
    outcome: str = "cancelled"
    """The `outcome` label of deja_requests_total (cancelled until the stream says otherwise)."""
    error: str | None = None
    """Set when the call must end with an error status (`_fail` maps outcome to the code)."""
    last_token_t: float | None = None
    sent: int = 0
    """Response messages yielded so far."""
    trailer: tuple[tuple[str, str], ...] = ()
    """Trailing metadata of the error status (the engine-dead marker for the router)."""

    def failed(self, e: Exception) -> None:
        """Maps an exception from the engine's stream to the call's outcome and error."""
        if isinstance(e, ValueError):
            if self.last is not None:
                self.outcome, self.error = "internal", f"engine failed mid-stream: {e}"
            else:
                self.outcome, self.error = "invalid_argument", str(e)
        elif isinstance(e, StreamOverflowError):
            self.outcome, self.error = "stream_overflow", str(e)
        elif isinstance(e, EngineDeadError):
            self.outcome, self.error = "internal", f"engine failed: {e}"
            self.trailer = engine_dead_trailer(self.sent)
        else:
            log.exception("request %s failed", self.stream.client_id)
            self.outcome, self.error = "internal", f"engine failed: {type(e).__name__}: {e}"


class _BadMessage:
    """Stands in for a request whose bytes do not parse, so the handler can say so."""

    def __init__(self, type_name: str, error: str) -> None:
        self.message = f"request is not a valid {type_name}: {error}"


class InferenceServicer:
    """deja.v1.Inference over one engine."""

    def __init__(
        self,
        engine: Engine,
        config: ServiceConfig,
        *,
        replica_id: str,
        health_servicer: health.aio.HealthServicer,
        metrics: ServiceMetrics,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self._engine = engine
        self._config = config
        self._auth = Auth(config.auth_tokens)
        self.replica_id = replica_id
        self._health = health_servicer
        self._metrics = metrics
        self._tracer = get_tracer(tracer_provider)
        self._model = engine.model_info.model_id
        self.streams: dict[str, _Stream] = {}
        self.draining = False
        self.engine_failed = False
        self.on_finished: Callable[[str, list[int], str | None], None] | None = None
        """Called as (session_id, prompt_token_ids, cache_salt) after each request that finished
        normally; `deja serve --redis-url` sets it to the replica agent's `record`."""
        self.kv_events = KvEventRing(engine.kv_snapshot, config.kv_event_ring_batches)
        """The engine's last KV-event batches (SubscribeKvEvents, the replica agent)."""
        engine.set_kv_event_sink(self.kv_events.publish)

    # -- helpers -------------------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return sum(1 for s in self.streams.values() if s.queued)

    async def _abort(
        self,
        context: grpc.aio.ServicerContext,
        code: grpc.StatusCode,
        msg: str,
        outcome: str,
        trailer: tuple[tuple[str, str], ...] = (),
    ) -> NoReturn:
        self._metrics.requests.labels(outcome).inc()
        await abort(context, code, msg, trailer)

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's tenant (None with auth off); aborts UNAUTHENTICATED otherwise."""
        try:
            return self._auth.tenant_for(context.invocation_metadata())
        except Unauthenticated as e:
            await self._abort(context, grpc.StatusCode.UNAUTHENTICATED, str(e), "unauthenticated")

    async def _check_request(
        self,
        request: Message | _BadMessage,
        context: grpc.aio.ServicerContext,
        *,
        allow_draining: bool = False,
    ) -> str | None:
        """Common entry checks; returns the tenant."""
        if isinstance(request, _BadMessage):
            await self._abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, request.message, "invalid_argument"
            )
        tenant = await self._authenticate(context)
        if self.draining and not allow_draining:
            await self._abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"replica {self.replica_id} is draining; retry on another replica",
                "rejected_draining",
            )
        return tenant

    async def engine_failed_now(self, error: BaseException | str) -> None:
        """Marks the engine dead: health NOT_SERVING for every service."""
        if not self.engine_failed:
            log.error("engine failed: %s", error)
        self.engine_failed = True
        for name in ("", SERVICE_NAME):
            await self._health.set(name, _NOT_SERVING)

    def _on_call_done(self, stream: _Stream) -> None:
        if not stream.done:
            stream.done = True
            self._engine.abort(stream.engine_id)

    # -- Generate ------------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest | _BadMessage, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        tenant = await self._admit(request, context)
        assert isinstance(request, pb.GenerateRequest)
        rec = await self._open(request, context, tenant)
        try:
            async with contextlib.aclosing(self._relay(rec)) as relay:
                async for resp in relay:
                    yield resp
                    rec.sent += 1
        except asyncio.CancelledError:
            if context.time_remaining() is not None and context.time_remaining() <= 0:
                rec.outcome = "deadline_exceeded"
            raise
        except Exception as e:
            rec.failed(e)
        finally:
            self._close(rec)
        if rec.error is not None:
            await self._fail(context, rec.outcome, rec.error, rec.trailer)

    async def _admit(
        self, request: pb.GenerateRequest | _BadMessage, context: grpc.aio.ServicerContext
    ) -> str | None:
        """Entry checks, engine health and admission control; returns the tenant."""
        tenant = await self._check_request(request, context)
        try:
            self._engine.check_health()
        except Exception as e:
            await self.engine_failed_now(e)
            await self._abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"the engine of replica {self.replica_id} has failed ({e}); retry on another "
                "replica",
                "rejected_engine_dead",
            )
        if self.num_queued >= self._config.max_queued_requests:
            await self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.num_queued} requests are already waiting on replica {self.replica_id} "
                f"(limit {self._config.max_queued_requests}); retry later or on another replica",
                "rejected_queue_full",
            )
        return tenant

    async def _open(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, tenant: str | None
    ) -> _StreamRecord:
        """Maps the request to engine types, registers the stream and starts its span and its
        engine request (which runs once the record's outputs are read)."""
        try:
            inp = convert.engine_input(request)
            params = convert.sampling_params(request)
        except ValueError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid_argument")
        client_id = request.request_id or uuid.uuid4().hex
        engine_id = client_id if tenant is None else f"{tenant}/{client_id}"
        if engine_id in self.streams:
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request id {client_id!r} is already running; pick a unique id or leave it empty",
                "invalid_argument",
            )
        salt = derive_cache_salt(tenant, request.cache_salt, self._config.allow_client_cache_salt)
        span = start_request_span(
            self._tracer,
            parent=extract_context(context.invocation_metadata()),
            operation=inp.operation,
            model=self._model,
            request_id=client_id,
            params=params,
            replica_id=self.replica_id,
            tenant=tenant,
        )
        stream = _Stream(engine_id, client_id, tenant)
        self.streams[engine_id] = stream
        context.add_done_callback(lambda _ctx: self._on_call_done(stream))
        self._metrics.active_streams.inc()
        outputs = self._engine.generate(
            inp.prompt, params, request_id=engine_id, messages=inp.messages, cache_salt=salt
        )
        return _StreamRecord(request, stream, salt, span, outputs)

    async def _relay(self, rec: _StreamRecord) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The engine's deltas as response messages, up to the final one (or an engine error)."""
        async with contextlib.aclosing(rec.outputs):  # type: ignore[type-var]
            async for out in rec.outputs:
                rec.stream.queued = False
                self._observe_itl(rec, rec.tally.add(out))
                resp = self._delta(rec.request, rec.stream.client_id, out, first=rec.last is None)
                rec.last = out
                if out.finished:
                    rec.stream.done = True
                    if out.error or "error" in rec.tally.finish_reasons():
                        rec.outcome, rec.error = "error", out.error or "engine error"
                        return
                    resp.final.CopyFrom(
                        convert.final_message(out, rec.tally, replica_id=self.replica_id)
                    )
                    rec.outcome = rec.tally.finish_reasons()[0] if rec.tally.ends else "stop"
                    if self.on_finished is not None:
                        self.on_finished(rec.request.session_id, out.prompt_token_ids, rec.salt)
                yield resp

    def _observe_itl(self, rec: _StreamRecord, new_tokens: int) -> None:
        """Inter-token latency: the gap since the last delta, spread over its new tokens."""
        if not new_tokens:
            return
        now = time.monotonic()
        if rec.last_token_t is not None:
            gap = (now - rec.last_token_t) / new_tokens
            for _ in range(new_tokens):
                self._metrics.itl.observe(gap)
        rec.last_token_t = now

    def _close(self, rec: _StreamRecord) -> None:
        """Unregisters the stream and records its outcome, usage and span."""
        rec.stream.done = True
        self.streams.pop(rec.stream.engine_id, None)
        self._metrics.active_streams.dec()
        if rec.error is None:  # failures are counted by _fail with their status
            self._metrics.requests.labels(rec.outcome).inc()
        self._record(rec.last, rec.tally)
        last = rec.last
        end_request_span(
            rec.span,
            last if last is not None and last.finished else None,
            completion_tokens=rec.tally.completion_tokens,
            finish_reasons=rec.tally.finish_reasons(),
            error=rec.error
            or (rec.outcome if rec.outcome in ("cancelled", "deadline_exceeded") else None),
        )

    @staticmethod
    def _delta(
        request: pb.GenerateRequest, client_id: str, out: RequestOutput, *, first: bool
    ) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=client_id)
        if request.return_token_ids and first:
            resp.prompt_token_ids.extend(out.prompt_token_ids)
        for c in out.outputs:
            resp.choices.append(convert.choice_delta(c, return_token_ids=request.return_token_ids))
        return resp

    async def _fail(
        self,
        context: grpc.aio.ServicerContext,
        outcome: str,
        error: str,
        trailer: tuple[tuple[str, str], ...] = (),
    ) -> None:
        if outcome == "invalid_argument":
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, error, outcome)
        if outcome == "stream_overflow":
            msg = f"the client read the stream too slowly; request aborted ({error})"
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, msg, outcome)
        try:
            self._engine.check_health()
        except Exception as e:
            await self.engine_failed_now(e)
        await self._abort(context, grpc.StatusCode.INTERNAL, error, "internal", trailer)

    def _record(self, last: RequestOutput | None, tally: convert.StreamTally) -> None:
        m = self._metrics
        m.generation_tokens.inc(tally.completion_tokens)
        if last is None or not last.finished:
            return
        m.prompt_tokens.inc(len(last.prompt_token_ids))
        for tier in ("device", "cpu", "disk"):
            m.cached_prompt_tokens.labels(tier).inc(getattr(last.cached_tokens, tier))
        t = last.metrics
        if t is not None:
            for hist, value in ((m.ttft, t.ttft), (m.queue_time, t.queue_time), (m.e2e, t.e2e)):
                if value is not None:
                    hist.observe(value)

    # -- unary calls ---------------------------------------------------------------------------

    async def Tokenize(
        self, request: pb.TokenizeRequest | _BadMessage, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        await self._check_request(request, context)
        assert isinstance(request, pb.TokenizeRequest)
        try:
            inp = convert.engine_input(request)
            ids = self._engine.tokenize(
                text=inp.prompt if isinstance(inp.prompt, str) else None, messages=inp.messages
            )
        except ValueError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid_argument")
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest | _BadMessage, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        await self._check_request(request, context)
        return convert.model_info_message(self._engine.model_info, self.replica_id)

    async def GetLoad(
        self, request: pb.GetLoadRequest | _BadMessage, context: grpc.aio.ServicerContext
    ) -> pb.Load:
        await self._check_request(request, context, allow_draining=True)
        return convert.load_message(
            self._engine.get_stats(),
            self.replica_id,
            active_streams=len(self.streams),
            queued_streams=self.num_queued,
            draining=self.draining,
        )

    async def GetCacheStats(
        self, request: pb.GetCacheStatsRequest | _BadMessage, context: grpc.aio.ServicerContext
    ) -> pb.CacheStats:
        await self._check_request(request, context)
        return convert.cache_stats_message(
            self._engine.get_stats(), self._engine.model_info, self.replica_id
        )

    async def Abort(
        self, request: pb.AbortRequest | _BadMessage, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        tenant = await self._check_request(request, context)
        assert isinstance(request, pb.AbortRequest)
        aborted = []
        for rid in request.request_ids:
            engine_id = rid if tenant is None else f"{tenant}/{rid}"
            if engine_id in self.streams and self._engine.abort(engine_id):
                aborted.append(rid)
        return pb.AbortResponse(aborted=aborted)

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest | _BadMessage, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvEventBatch]:
        await self._check_request(request, context)
        assert isinstance(request, pb.SubscribeKvEventsRequest)
        with_tokens = not self._auth.enabled
        batches = self.kv_events.subscribe(request.start_sequence_number)
        async with contextlib.aclosing(batches):  # type: ignore[type-var]
            async for batch in batches:
                for msg in convert.kv_batch_messages(batch, with_tokens=with_tokens):
                    yield msg


# -- registration ------------------------------------------------------------------------------


def _deserializer(cls: type[Message]) -> Callable[[bytes], Message | _BadMessage]:
    def deserialize(data: bytes) -> Message | _BadMessage:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return _BadMessage(cls.DESCRIPTOR.full_name, str(e) or "cannot parse")

    return deserialize


def add_inference_servicer(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Registers the servicer like the generated add_InferenceServicer_to_server, except that an
    undecodable request reaches the handler (to answer INVALID_ARGUMENT, not INTERNAL)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in pb.DESCRIPTOR.services_by_name["Inference"].methods:
        req_cls = getattr(pb, method.input_type.name)
        resp_cls = getattr(pb, method.output_type.name)
        make: Callable[..., grpc.RpcMethodHandler] = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_deserializer(req_cls),
            response_serializer=resp_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# -- the replica -------------------------------------------------------------------------------


@dataclass(slots=True)
class Replica:
    """A started server; `shutdown()` drains and stops it (the engine is the caller's)."""

    server: grpc.aio.Server
    servicer: InferenceServicer
    health: health.aio.HealthServicer
    metrics: ServiceMetrics
    port: int
    metrics_port: int | None
    _monitor: asyncio.Task[None]

    @property
    def replica_id(self) -> str:
        return self.servicer.replica_id

    async def shutdown(self, grace_period_s: float) -> None:
        """Health NOT_SERVING, refuse new calls (UNAVAILABLE), let running streams finish for up
        to `grace_period_s`, abort the rest (their streams end with finish_reason ABORT), stop."""
        s = self.servicer
        s.draining = True
        s.kv_events.close()
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + grace_period_s
        while s.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if s.streams:
            log.warning("grace period over; aborting %d streams", len(s.streams))
            for stream in list(s.streams.values()):
                s._engine.abort(stream.engine_id)
            end = time.monotonic() + 2.0
            while s.streams and time.monotonic() < end:
                await asyncio.sleep(0.02)
        self._monitor.cancel()
        await self.server.stop(grace=0.5)
        self.metrics.stop_http()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def _monitor(servicer: InferenceServicer, engine: Engine, interval_s: float) -> None:
    """Refreshes engine gauges and turns health NOT_SERVING when the engine dies."""
    m = servicer._metrics
    while True:
        try:
            engine.check_health()
        except Exception as e:
            await servicer.engine_failed_now(e)
        try:
            m.update_engine_stats(engine.get_stats())
        except Exception:
            log.debug("get_stats failed", exc_info=True)
        m.queued_streams.set(servicer.num_queued)
        await asyncio.sleep(interval_s)


async def serve(
    config: ServiceConfig,
    engine: Engine,
    *,
    tracer_provider: TracerProvider | None = None,
    monitor_interval_s: float = 0.5,
) -> Replica:
    """Builds, binds and starts the server on the running event loop."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    address = f"{config.host}:{config.port}"
    if config.tls_cert is not None and config.tls_key is not None:
        with open(config.tls_key, "rb") as k, open(config.tls_cert, "rb") as c:
            creds = grpc.ssl_server_credentials([(k.read(), c.read())])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    replica_id = config.effective_replica_id(port)
    health_servicer = health.aio.HealthServicer()
    metrics = ServiceMetrics(engine.model_info.model_id)
    servicer = InferenceServicer(
        engine,
        config,
        replica_id=replica_id,
        health_servicer=health_servicer,
        metrics=metrics,
        tracer_provider=tracer_provider,
    )
    add_inference_servicer(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [SERVICE_NAME, health.SERVICE_NAME]
    if config.reflection:
        names.append(reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, _SERVING)
    metrics_port = None
    if config.metrics_port is not None:
        metrics_port = metrics.start_http(config.metrics_host, config.metrics_port)
    monitor = asyncio.get_running_loop().create_task(_monitor(servicer, engine, monitor_interval_s))
    return Replica(server, servicer, health_servicer, metrics, port, metrics_port, monitor)
