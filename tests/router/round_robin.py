"""Two `deja serve` replicas (tiny model) behind a real round-robin `deja route`, each a process."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from clients.testing.cluster import (
    ProcessGroup,
    route_argv,
    serve_argv,
    wait_healthy,
    wait_router_replicas,
)
from service.common.ports import free_port

REPLICAS = ("r0", "r1")


def _ports() -> dict[str, int]:
    return {name: free_port() for name in (*REPLICAS, "router")}


@dataclass
class RoundRobinCluster:
    group: ProcessGroup
    ports: dict[str, int] = field(default_factory=_ports)
    """gRPC port of each replica (REPLICAS) and of "router"."""
    metrics_port: int = field(default_factory=free_port)
    """The router's Prometheus port."""

    def target(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def start(
        self, model: str, serve_extra: Sequence[str], healthy_timeout_s: float = 120.0
    ) -> None:
        """Spawns the replicas (with `serve_extra` flags) and the router; returns once the router
        counts both replicas healthy."""
        for name in REPLICAS:
            argv = serve_argv(model, port=self.ports[name], replica_id=name, extra=serve_extra)
            self.group.spawn(name, argv)
        argv = route_argv(
            port=self.ports["router"],
            replicas=[self.target(name) for name in REPLICAS],
            policy="round_robin",
            model=model,
            metrics_port=self.metrics_port,
            extra=["--poll-interval", "0.25"],
        )
        self.group.spawn("router", argv)
        for name in REPLICAS:
            wait_healthy(self.group, name, self.target(name), timeout_s=healthy_timeout_s)
        wait_router_replicas(self.group, "router", self.metrics_port, len(REPLICAS))
