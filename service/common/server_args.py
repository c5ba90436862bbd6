"""Settings both servers (`deja serve` and `deja route`) take from flags of the same names."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from service.common.auth import parse_auth_token
from service.common.flags import ConfigFlag, add_config_flags, add_list_flag, config_values


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


_SERVER_FLAGS = (
    ConfigFlag(
        "allow_client_cache_salt", bool, "With auth on, also honour the client's cache_salt."
    ),
    ConfigFlag("reflection", bool, "gRPC server reflection."),
    ConfigFlag("grace_period_s", float, "Seconds running streams may finish after SIGTERM."),
    ConfigFlag("metrics_port", int, "Prometheus endpoint port (unset: off)."),
    ConfigFlag("metrics_host", str, "Prometheus endpoint host."),
    ConfigFlag("otlp_endpoint", str, "OTLP/gRPC trace collector (unset: no export)."),
    ConfigFlag("console_tracing", bool, "Print spans on stdout."),
)
"""The ServerSettings fields set by flags (all but auth_tokens), in --help order."""


def add_server_args(
    group: argparse._ArgumentGroup, defaults: ServerSettings, *, auth_help: str
) -> list[argparse.Action]:
    """The flags of the ServerSettings fields: --auth-token (`auth_help` says what the server
    does with the tokens), then auth, reflection, shutdown and observability."""
    return [
        add_list_flag(group, "--auth-token", metavar="TOKEN[:TENANT]", help=auth_help),
        *add_config_flags(group, defaults, _SERVER_FLAGS),
    ]


def server_settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerSettings keyword arguments: auth, reflection, shutdown, observability."""
    return {
        "auth_tokens": tuple(parse_auth_token(s) for s in args.auth_token),
        **config_values(args, _SERVER_FLAGS),
    }
