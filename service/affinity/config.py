"""Settings shared by the replica agent and the router for talking to the affinity store."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import check


@dataclass(frozen=True, slots=True)
class AffinityConfig:
    redis_url: str | None = None
    """redis:// or rediss:// URL; None keeps everything in process memory."""
    key_prefix: str = "deja:"
    """Prefix of every Redis key, so several deployments can share one Redis."""
    op_timeout_s: float = 0.25
    """Upper bound of one store call (socket reads included)."""
    connect_timeout_s: float = 0.25
    reconnect_interval_s: float = 1.0
    """Pause between background reconnect attempts while Redis is unreachable."""
    max_connections: int = 32
    """Connection pool size per process."""
    heartbeat_s: float = 1.0
    """How often a replica refreshes its registration and publishes its load."""
    replica_ttl_s: float = 5.0
    """A replica that has not heartbeated for this long drops out of the registry."""
    session_ttl_s: float = 3600.0
    """How long `session_id -> replica` outlives the session's last turn."""
    prefix_ttl_s: float = 1800.0
    """How long a prefix record outlives its last refresh."""
    prefix_flush_s: float = 0.15
    """The replica agent writes the prefix changes of KV events at most this often; a burst of
    engine steps in between costs one write."""
    max_blocks_per_record: int = 256
    """Most block hashes one request records (the first ones and the last one beyond that)."""

    def __post_init__(self) -> None:
        check(
            self.redis_url is None
            or self.redis_url.startswith(("redis://", "rediss://", "unix://")),
            f"redis url must start with redis://, rediss:// or unix://, got {self.redis_url!r}",
        )
        for name in (
            "op_timeout_s",
            "connect_timeout_s",
            "reconnect_interval_s",
            "heartbeat_s",
            "replica_ttl_s",
            "session_ttl_s",
            "prefix_ttl_s",
            "prefix_flush_s",
        ):
            check(getattr(self, name) > 0, f"{name} must be > 0")
        check(self.max_connections >= 1, "max_connections must be >= 1")
        check(self.max_blocks_per_record >= 1, "max_blocks_per_record must be >= 1")
        check(
            self.replica_ttl_s > self.heartbeat_s,
            "replica_ttl_s must exceed heartbeat_s, or live replicas would flicker out",
        )
