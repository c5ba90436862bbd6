"""Prometheus metrics of the router, on their own registry and HTTP port (off by default)."""

from __future__ import annotations

from service.common.metrics_http import MetricsEndpoint

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics(MetricsEndpoint):
    def __init__(self) -> None:
        super().__init__()
        self.requests = self.counter(
            "deja_router_requests",
            "Generate calls by chosen replica, routing reason and outcome (ok or a status name).",
            ["replica", "reason", "outcome"],
        )
        self.fallback = self.counter(
            "deja_router_fallback",
            "Routing decisions made without the affinity store (unreachable or slow).",
        )
        self.store_errors = self.counter(
            "deja_router_store_errors", "Affinity store calls that failed, by operation.", ["op"]
        )
        self.retries = self.counter(
            "deja_router_retries",
            "Generate calls retried on another replica before their first message, by reason "
            "(unavailable, engine_dead, queue_full: service/router/retry.py).",
            ["reason"],
        )
        self.replicas = self.gauge(
            "deja_router_replicas", "Replicas known to the router, by state.", ["state"]
        )
        self.inflight = self.gauge("deja_router_inflight", "Generate streams open.")
        self.ttft = self.histogram(
            "deja_router_time_to_first_message_seconds",
            "From receiving a Generate call to relaying its first message.",
            _TTFT_BUCKETS,
        )
