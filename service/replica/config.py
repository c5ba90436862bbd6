"""The replica's service settings: one frozen dataclass, built from flags / DEJA_* variables."""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass

from engine.config import check, check_port
from service.common.flags import ConfigFlag, add_config_flags, add_flag, config_values
from service.common.server_args import ServerSettings, add_server_args, server_settings_from_args


@dataclass(frozen=True, slots=True)
class ServiceConfig(ServerSettings):
    """The replica's settings; the server fields both servers share are in ServerSettings."""

    host: str = "127.0.0.1"
    """Interface to listen on (0.0.0.0 for every interface)."""
    port: int = 50051
    """gRPC port; 0 picks a free one (serve() reports it)."""
    replica_id: str = ""
    """Reported in responses, load and metrics; empty: <hostname>:<port>."""
    max_queued_requests: int = 1024
    """Generate calls admitted but not yet producing tokens; beyond: RESOURCE_EXHAUSTED."""
    stream_buffer: int = 1024
    """Engine outputs buffered per stream before a slow reader's request is aborted."""
    tls_cert: str | None = None
    """PEM certificate chain file; with tls_key, serve TLS instead of plaintext."""
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """PEM CA bundle; with it the replica requires a client certificate that chains to it (mTLS):
    a caller without one fails the TLS handshake. Bearer tokens still apply on top."""
    redis_url: str | None = None
    """Affinity store shared with the router (the replica agent writes it)."""
    kv_event_ring_batches: int = 1024
    """KV-event batches (one per engine step with events) kept for SubscribeKvEvents to resume
    from; a subscriber further behind gets a snapshot."""

    def __post_init__(self) -> None:
        check_port("port", self.port)
        check(self.max_queued_requests >= 1, "max_queued_requests must be >= 1")
        check(self.stream_buffer >= 1, "stream_buffer must be >= 1")
        check(self.grace_period_s >= 0, "grace_period_s must be >= 0")
        check(self.kv_event_ring_batches >= 1, "kv_event_ring_batches must be >= 1")
        check(
            (self.tls_cert is None) == (self.tls_key is None),
            "TLS needs both a certificate and a key",
        )
        check(
            self.tls_client_ca is None or self.tls_cert is not None,
            "tls_client_ca (client certificates) needs tls_cert and tls_key: mTLS is TLS",
        )
        check_port("metrics_port", self.metrics_port)
        tokens = [t for t, _ in self.auth_tokens]
        check(all(tokens), "auth tokens must not be empty")
        check(len(set(tokens)) == len(tokens), "auth tokens must be unique")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.auth_tokens)

    @property
    def tenants(self) -> dict[str, str]:
        """Bearer token -> tenant identity."""
        return dict(self.auth_tokens)

    def effective_replica_id(self, bound_port: int) -> str:
        return self.replica_id or f"{socket.gethostname()}:{bound_port}"


_SERVICE_FLAGS = (
    ConfigFlag(
        "max_queued_requests",
        int,
        "Streams waiting for their first token before RESOURCE_EXHAUSTED.",
    ),
    ConfigFlag(
        "stream_buffer", int, "Outputs buffered per stream before a slow reader is cut off."
    ),
    ConfigFlag(
        "kv_event_ring_batches",
        int,
        "KV-event batches kept for SubscribeKvEvents subscribers to resume from.",
    ),
)
"""The replica's queue and buffer sizes set by flags, in --help order."""


def add_service_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    g = parser.add_argument_group("service")
    d = ServiceConfig()
    return [
        add_flag(g, "--host", default=d.host, help="Interface to listen on."),
        add_flag(g, "--port", type=int, default=d.port, help="gRPC port (0: a free one)."),
        add_flag(g, "--replica-id", help="Replica name in responses and metrics (host:port)."),
        *add_config_flags(g, d, _SERVICE_FLAGS),
        *add_server_args(
            g,
            d,
            auth_help="Require `authorization: Bearer TOKEN`; TENANT names the caller's cache.",
        ),
        add_flag(g, "--tls-cert", help="PEM certificate chain (with --tls-key: serve TLS)."),
        add_flag(g, "--tls-key", help="PEM private key."),
        add_flag(g, "--tls-client-ca", help="PEM CA: require client certs it signed (mTLS)."),
        add_flag(g, "--redis-url", help="Affinity store shared with the router."),
    ]


def service_config_from_args(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(
        host=args.host,
        port=args.port,
        replica_id=args.replica_id or "",
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        redis_url=args.redis_url,
        **config_values(args, _SERVICE_FLAGS),
        **server_settings_from_args(args),
    )
