"""A Prometheus registry and the HTTP endpoint that serves it (`/metrics`, off by default)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class MetricsEndpoint:
    """Owns `registry`; `start_http` serves it in the Prometheus text format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        """A Counter on `registry` (exported as `<name>_total`)."""
        return Counter(name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        """A Gauge on `registry`."""
        return Gauge(name, doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        """A Histogram on `registry` with these bucket upper bounds (seconds)."""
        return Histogram(name, doc, buckets=buckets, registry=self.registry)

    def start_http(self, host: str, port: int) -> int:
        """Serves /metrics on a daemon thread; returns the bound port."""
        self._http, self._thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
