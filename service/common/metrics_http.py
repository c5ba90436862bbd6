"""A Prometheus registry and the HTTP endpoint that serves it (`/metrics`, off by default)."""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


class MetricsEndpoint:
    """Owns `registry`; `start_http` serves it in the Prometheus text format."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
