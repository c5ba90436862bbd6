"""What every RPC of the replica's servicer shares: the `Engine` it serves, the servicer's state
(`ServicerBase`: streams, draining, engine health) and the entry checks (undecodable message,
auth, draining) with their status codes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, NoReturn, Protocol

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2
from opentelemetry.sdk.trace import TracerProvider

from engine.kv.events import KVEventBatch, KVSnapshot
from engine.outputs import RequestOutput
from engine.sample.sampling_params import SamplingParams
from engine.stats import EngineStats, ModelInfo
from service.common.auth import Auth, Unauthenticated
from service.common.rpc import SERVICE_NAME, abort
from service.common.tracing import get_tracer
from service.replica.config import ServiceConfig
from service.replica.kv_events import KvEventRing
from service.replica.metrics import ServiceMetrics
from service.replica.streams import Stream

log = logging.getLogger(__name__)

_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Engine(Protocol):
    """What the server needs from an engine: engine.frontend.core_client.EngineCoreClient (the engine core
    in its own process) or engine.frontend.async_engine.AsyncEngine (the step loop in a thread)."""

    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (its `name_or_path` is the checkpoint folder)."""
        ...

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


class BadMessage:
    """Stands in for a request whose bytes do not parse, so the handler can say so."""

    def __init__(self, type_name: str, error: str) -> None:
        self.message = f"request is not a valid {type_name}: {error}"


class ServicerBase:
    """The servicer's state and the checks each call starts with; the RPCs are in the mixins that
    service/replica/server.py's InferenceServicer puts together."""

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
        self.streams: dict[str, Stream] = {}
        self.draining = False
        self.engine_failed = False
        self.on_finished: Callable[[str, list[int], str | None], None] | None = None
        """Called as (session_id, prompt_token_ids, cache_salt) after each request that finished
        normally; `deja serve --redis-url` sets it to the replica agent's `record`."""
        self.kv_events = KvEventRing(engine.kv_snapshot, config.kv_event_ring_batches)
        """The engine's last KV-event batches (SubscribeKvEvents, the replica agent)."""
        engine.set_kv_event_sink(self.kv_events.publish)

    @property
    def num_queued(self) -> int:
        return sum(1 for s in self.streams.values() if s.queued)

    def abort_own(self, tenant: str | None, request_ids: Iterable[str]) -> list[str]:
        """Aborts those of `request_ids` that the tenant has running; returns them."""
        aborted = []
        for rid in request_ids:
            engine_id = rid if tenant is None else f"{tenant}/{rid}"
            if engine_id in self.streams and self._engine.abort(engine_id):
                aborted.append(rid)
        return aborted

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
        request: Message | BadMessage,
        context: grpc.aio.ServicerContext,
        *,
        allow_draining: bool = False,
    ) -> str | None:
        """Common entry checks; returns the tenant."""
        if isinstance(request, BadMessage):
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
