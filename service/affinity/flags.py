"""Affinity-store flags shared by `deja route` and `deja serve` (each reads DEJA_* too)."""

from __future__ import annotations

import argparse

from service.affinity.config import AffinityConfig
from service.common.flags import add_flag


def add_affinity_args(parser: argparse.ArgumentParser, *, with_url: bool) -> None:
    """Adds the store flags; `with_url=False` where the command already has --redis-url."""
    d = AffinityConfig()
    a = parser.add_argument_group("affinity store")
    if with_url:
        add_flag(a, "--redis-url", help="Affinity store (unset: in-memory, this process only).")
    add_flag(a, "--redis-key-prefix", default=d.key_prefix, help="Prefix of every Redis key.")
    add_flag(a, "--redis-timeout", type=float, default=d.op_timeout_s, help="Per call (s).")
    add_flag(a, "--heartbeat", type=float, default=d.heartbeat_s, help="Replica heartbeat (s).")
    add_flag(a, "--replica-ttl", type=float, default=d.replica_ttl_s, help="Registration TTL (s).")
    add_flag(a, "--session-ttl", type=float, default=d.session_ttl_s, help="Session TTL (s).")
    add_flag(a, "--prefix-ttl", type=float, default=d.prefix_ttl_s, help="Prefix record TTL (s).")
    add_flag(
        a,
        "--max-blocks-per-record",
        type=int,
        default=d.max_blocks_per_record,
        help="Block hashes one request records.",
    )


def affinity_config_from_args(args: argparse.Namespace) -> AffinityConfig:
    return AffinityConfig(
        redis_url=args.redis_url or None,
        key_prefix=args.redis_key_prefix,
        op_timeout_s=args.redis_timeout,
        connect_timeout_s=args.redis_timeout,
        heartbeat_s=args.heartbeat,
        replica_ttl_s=args.replica_ttl,
        session_ttl_s=args.session_ttl,
        prefix_ttl_s=args.prefix_ttl,
        max_blocks_per_record=args.max_blocks_per_record,
    )
