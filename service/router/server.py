"""The router process: builds and starts the gRPC server (Inference, health, reflection, metrics)
over a replica pool and an affinity store, and drains it on shutdown.

Health is SERVING while at least one replica is healthy, so a load balancer or a Kubernetes
readiness probe only sends traffic to a router that can route it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.sdk.trace import TracerProvider

from service.affinity.base import AffinityStore
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from service.common.rpc import SERVICE_NAME
from service.router.config import RouterConfig
from service.router.metrics import RouterMetrics
from service.router.pool import ReplicaPool
from service.router.prompt import PromptHasher
from service.router.servicer import RouterServicer

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(slots=True)
class Router:
    """A started router; `shutdown()` drains and stops it."""

    server: grpc.aio.Server
    servicer: RouterServicer
    pool: ReplicaPool
    store: AffinityStore
    health: health.aio.HealthServicer
    metrics: RouterMetrics
    port: int
    metrics_port: int | None
    _monitor: asyncio.Task[None]

    async def shutdown(self, grace_period_s: float) -> None:
        """Health NOT_SERVING, new calls UNAVAILABLE, open streams get `grace_period_s`."""
        self.servicer.draining = True
        self._monitor.cancel()
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + grace_period_s
        while self.servicer.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(grace=0.5)
        await self.pool.close()
        await self.store.close()
        self.metrics.stop_http()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def _monitor(
    pool: ReplicaPool, health_servicer: health.aio.HealthServicer, interval_s: float
) -> None:
    """SERVING while at least one replica is healthy."""
    last: int | None = None
    while True:
        status = _SERVING if pool.healthy() else _NOT_SERVING
        if status != last:
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)
            last = status
        await asyncio.sleep(interval_s)


async def serve_router(
    config: RouterConfig,
    *,
    store: AffinityStore,
    tokenizer: Any | None = None,
    tracer_provider: TracerProvider | None = None,
) -> Router:
    """Builds, binds and starts the router on the running event loop (the store is its to close)."""
    metrics = RouterMetrics()
    poll_md = (
        [("authorization", f"Bearer {config.auth_tokens[0][0]}")] if config.auth_tokens else []
    )
    pool = ReplicaPool(config, store, metrics, call_metadata=poll_md)
    await pool.start()
    hasher = PromptHasher(tokenizer, config.auth_tokens, config.allow_client_cache_salt)
    servicer = RouterServicer(config, pool, store, hasher, metrics, tracer_provider)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    metrics_port = None
    if config.metrics_port is not None:
        metrics_port = metrics.start_http(config.metrics_host, config.metrics_port)
    monitor = asyncio.get_running_loop().create_task(
        _monitor(pool, health_servicer, min(config.poll_interval_s, 0.5))
    )
    return Router(
        server, servicer, pool, store, health_servicer, metrics, port, metrics_port, monitor
    )
