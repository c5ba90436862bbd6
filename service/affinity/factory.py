"""Builds the affinity store a config asks for."""

from __future__ import annotations

from service.affinity.base import AffinityStore
from service.affinity.config import AffinityConfig
from service.affinity.memory import MemoryAffinityStore


def create_store(config: AffinityConfig) -> AffinityStore:
    """Redis when a URL is configured, else the in-memory store."""
    if config.redis_url is None:
        return MemoryAffinityStore()
    from service.affinity.redis_store import RedisAffinityStore

    return RedisAffinityStore(
        config.redis_url,
        key_prefix=config.key_prefix,
        op_timeout_s=config.op_timeout_s,
        connect_timeout_s=config.connect_timeout_s,
        max_connections=config.max_connections,
        reconnect_interval_s=config.reconnect_interval_s,
    )
