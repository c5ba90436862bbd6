"""The replica: a grpc.aio server over the AsyncEngine.

`InferenceServicer` only translates between deja.v1 messages and engine types
(service/replica/convert.py) and maps failures to status codes:

    no client certificate (tls_client_ca set)             TLS handshake fails (caller: UNAVAILABLE)
    bad input (engine ValueError, undecodable message)   INVALID_ARGUMENT, the engine's message
    missing / unknown bearer token (auth on)              UNAUTHENTICATED
    more than max_queued_requests waiting for a token    RESOURCE_EXHAUSTED
    per-stream buffer overflow (slow reader)             RESOURCE_EXHAUSTED (request aborted)
    draining                                             UNAVAILABLE
    engine failure                                       INTERNAL, health turns NOT_SERVING
    engine core died under an open stream                UNAVAILABLE + trailer (common/failover.py)

Its state and entry checks are in service/replica/servicer_base.py, Generate in
service/replica/generate.py, the other RPCs in service/replica/admin.py.

`serve(config, engine)` builds and starts the server (health, optional reflection, optional
metrics endpoint) and returns a `Replica`; `Replica.shutdown()` drains it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider

from service.api.deja.v1 import inference_pb2 as pb
from service.common.rpc import SERVICE_NAME
from service.replica.admin import AdminRpcs
from service.replica.config import ServiceConfig
from service.replica.generate import GenerateRpc
from service.replica.metrics import ServiceMetrics
from service.replica.servicer_base import BadMessage, Engine
from service.replica.vllm_servicer import (
    VLLM_SERVICE_NAME,
    VllmEngineServicer,
    add_vllm_servicer,
    tokenizer_dir,
)

log = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING


class InferenceServicer(GenerateRpc, AdminRpcs):
    """deja.v1.Inference over one engine."""


# -- registration ------------------------------------------------------------------------------


def _deserializer(cls: type[Message]) -> Callable[[bytes], Message | BadMessage]:
    def deserialize(data: bytes) -> Message | BadMessage:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return BadMessage(cls.DESCRIPTOR.full_name, str(e) or "cannot parse")

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


def server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS from tls_cert/tls_key (None: plaintext); with tls_client_ca, client certificates
    chaining to it are required (mTLS): without one the handshake fails, before any RPC."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    with open(config.tls_key, "rb") as k, open(config.tls_cert, "rb") as c:
        pair = (k.read(), c.read())
    if config.tls_client_ca is None:
        return grpc.ssl_server_credentials([pair])
    with open(config.tls_client_ca, "rb") as ca:
        return grpc.ssl_server_credentials(
            [pair], root_certificates=ca.read(), require_client_auth=True
        )


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
    creds = server_credentials(config)
    port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
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
    add_vllm_servicer(VllmEngineServicer(servicer, tokenizer_dir(engine)), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [SERVICE_NAME, VLLM_SERVICE_NAME, health.SERVICE_NAME]
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
