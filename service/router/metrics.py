"""Prometheus metrics of the router, on their own registry and HTTP port (off by default)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from service.common.metrics_http import MetricsEndpoint

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics(MetricsEndpoint):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
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
