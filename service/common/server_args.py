"""Settings both servers (`deja serve` and `deja route`) take from flags of the same names."""

from __future__ import annotations

import argparse
from typing import Any

from service.common.auth import parse_auth_token


def server_settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """ServiceConfig / RouterConfig keyword arguments: auth, reflection, shutdown, observability."""
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
