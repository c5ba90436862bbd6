"""Settings both servers (`deja serve` and `deja route`) take from flags of the same names."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from service.common.auth import parse_auth_token


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The fields ServiceConfig and RouterConfig share (each checks them in its __post_init__)."""

    auth_tokens: tuple[tuple[str, str], ...] = ()
    """(bearer token, tenant) pairs. A replica accepts these (empty turns auth off); the router
    holds its replicas' list only to hash prompts with the tenant's cache salt."""
    allow_client_cache_salt: bool = False
    """With auth on, also honour a client's cache_salt (inside the tenant's own cache)."""
    reflection: bool = True
    """Serve grpc.reflection.v1alpha (what grpcurl `list` uses)."""
    grace_period_s: float = 30.0
    """On SIGTERM/SIGINT, how long running streams may finish before they are aborted."""
    metrics_port: int | None = None
    """Prometheus text endpoint port; None: off."""
    metrics_host: str = "127.0.0.1"
    otlp_endpoint: str | None = None
    """OTLP/gRPC collector address (e.g. http://localhost:4317); None: no OTLP export."""
    console_tracing: bool = False
    """Print finished spans on stdout."""


def server_settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerSettings keyword arguments: auth, reflection, shutdown, observability."""
    return {
        "auth_tokens": tuple(parse_auth_token(s) for s in args.auth_token),
        "allow_client_cache_salt": args.allow_client_cache_salt,
        "reflection": args.reflection,
        "grace_period_s": args.grace_period,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "otlp_endpoint": args.otlp_endpoint,
        "console_tracing": args.console_tracing,
    }
