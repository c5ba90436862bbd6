"""Affinity-store flags shared by `deja route` and `deja serve` (each reads DEJA_* too)."""

from __future__ import annotations

import argparse

from service.affinity.config import AffinityConfig
from service.common.flags import ConfigFlag, add_config_flags, add_flag, config_values

_AFFINITY_FLAGS = (
    ConfigFlag("key_prefix", str, "Prefix of every Redis key.", flag="--redis-key-prefix"),
    ConfigFlag("op_timeout_s", float, "Per call (s).", flag="--redis-timeout"),
    ConfigFlag("heartbeat_s", float, "Replica heartbeat (s)."),
    ConfigFlag("replica_ttl_s", float, "Registration TTL (s)."),
    ConfigFlag("session_ttl_s", float, "Session TTL (s)."),
    ConfigFlag("prefix_ttl_s", float, "Prefix record TTL (s)."),
    ConfigFlag("max_blocks_per_record", int, "Block hashes one request records."),
)
"""The AffinityConfig fields set by flags (besides --redis-url), in --help order."""


def add_affinity_args(parser: argparse.ArgumentParser, *, with_url: bool) -> None:
    """Adds the store flags; `with_url=False` where the command already has --redis-url."""
    a = parser.add_argument_group("affinity store")
    if with_url:
        add_flag(a, "--redis-url", help="Affinity store (unset: in-memory, this process only).")
    add_config_flags(a, AffinityConfig(), _AFFINITY_FLAGS)


def affinity_config_from_args(args: argparse.Namespace) -> AffinityConfig:
    """--redis-timeout bounds the connect as well as each call."""
    return AffinityConfig(
        redis_url=args.redis_url or None,
        connect_timeout_s=args.redis_timeout,
        **config_values(args, _AFFINITY_FLAGS),
    )
