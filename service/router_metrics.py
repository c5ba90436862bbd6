"""Prometheus metrics of the router, on their own registry and HTTP port (off by default)."""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "deja_router_requests",
            "Generate calls by chosen replica, routing reason and outcome (ok or a status name).",
            ["replica", "reason", "outcome"],
            registry=r,
        )
        self.fallback = Counter(
            "deja_router_fallback",
            "Routing decisions made without the affinity store (unreachable or slow).",
            registry=r,
        )
        self.store_errors = Counter(
            "deja_router_store_errors",
            "Affinity store calls that failed, by operation.",
            ["op"],
            registry=r,
        )
        self.retries = Counter(
            "deja_router_retries",
            "Generate calls retried on another replica (UNAVAILABLE before the first message).",
            registry=r,
        )
        self.replicas = Gauge(
            "deja_router_replicas", "Replicas known to the router, by state.", ["state"], registry=r
        )
        self.inflight = Gauge("deja_router_inflight", "Generate streams open.", registry=r)
        self.ttft = Histogram(
            "deja_router_time_to_first_message_seconds",
            "From receiving a Generate call to relaying its first message.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start_http(self, host: str, port: int) -> int:
        """Serves /metrics on a daemon thread; returns the bound port."""
        self._http, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
