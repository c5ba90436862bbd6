"""The affinity store: what the router and the replicas share about placement.

Three kinds of record live in the store:

- **replica registry**: each replica registers its identity (`ReplicaInfo`) and publishes its
  load (`ReplicaLoad`) on every heartbeat; a registration lives for `ttl_s` seconds, so a replica
  that stops heartbeating drops out of `list_replicas` on its own.
- **session affinity**: `session_id -> replica_id`, refreshed on every turn, expiring after `ttl_s`.
- **prefix records**: which block hashes (the engine's process-stable hashes from
  `engine.kv.hashing`) a replica holds, each with its own expiry and the tier that holds it
  ("device", "cpu", "disk" or "remote"; a record written without one is a device record). Hashes are
  chained, so holding block `i` implies holding blocks `0..i`; a record may therefore be sparse
  and still answers "how long a prefix does replica R hold". A block without a record inside a
  replica's prefix counts in the tier of the next deeper record (earlier blocks are at least as
  hot: the engine evicts a prompt's tail first).

Rules every implementation keeps:

- Every method is bounded in time and raises only `AffinityStoreError` on failure (connection
  lost, timeout, bad data). Callers treat the store as an optimisation: they catch that one error
  and route without it; no request may fail because of the store.
- Expired records are never returned. Expiry uses the store's own clock; TTLs are in seconds.
- Writes are idempotent: registering, recording a session or a prefix again refreshes the TTL.
- Nothing here blocks the event loop for long; the in-memory store does no I/O at all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.kv.hashing import BlockHash
from service.affinity.prefix import TierBlocks

TIERS = ("device", "cpu", "disk", "remote")
TIER_INDEX = {t: i for i, t in enumerate(TIERS)}


class AffinityStoreError(RuntimeError):
    """The store could not answer in time or at all; route without it."""


def check_tier(tier: str) -> None:
    """Raises ValueError unless `tier` is one of `TIERS`."""
    if tier not in TIER_INDEX:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What a replica is; fixed for its lifetime."""

    replica_id: str
    address: str
    """host:port other processes reach its gRPC server at."""
    model_id: str
    """Model identity mixed into block hashes; the router hashes with the replica's value."""
    block_size: int
    """Tokens per KV block; the router hashes prompts with it."""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's load as of its last heartbeat."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    """Share of device KV blocks in use by running requests, in [0, 1]."""
    hit_rate: float = 0.0
    """Prefix-cache hit rate over prompt tokens since start, in [0, 1]."""


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One live registration."""

    info: ReplicaInfo
    load: ReplicaLoad
    updated_at: float
    """Unix time of the last heartbeat, as written by the replica."""


class AffinityStore(ABC):
    """Replica registry, session affinity and prefix records behind one small interface."""

    @property
    @abstractmethod
    def available(self) -> bool:
        """False while the store is known to be unreachable (calls then fail fast)."""

    # Replica registry.

    @abstractmethod
    async def register(self, info: ReplicaInfo, load: ReplicaLoad, ttl_s: float) -> None:
        """Registers or refreshes (heartbeats) a replica and publishes its load."""

    @abstractmethod
    async def deregister(self, replica_id: str) -> None:
        """Removes a replica at once (clean shutdown); its other records expire on their own."""

    @abstractmethod
    async def list_replicas(self) -> list[ReplicaStatus]:
        """Live registrations, sorted by replica id."""

    # Session affinity.

    @abstractmethod
    async def set_session(self, session_id: str, replica_id: str, ttl_s: float) -> None:
        """Points a session at a replica, replacing any earlier choice."""

    @abstractmethod
    async def get_session(self, session_id: str) -> str | None:
        """The session's replica id, or None if unknown or expired."""

    # Prefix records.

    async def record_prefix(
        self,
        replica_id: str,
        block_hashes: Sequence[BlockHash],
        ttl_s: float,
        tier: str = "device",
    ) -> None:
        """Records that the replica holds these blocks (a chain, possibly sparse) in `tier`,
        replacing the tier of earlier records of the same blocks. A tier not in `TIERS` raises
        ValueError."""
        check_tier(tier)
        await self._record_prefix(replica_id, block_hashes, ttl_s, tier)

    @abstractmethod
    async def _record_prefix(
        self, replica_id: str, block_hashes: Sequence[BlockHash], ttl_s: float, tier: str
    ) -> None:
        """`record_prefix` once its tier is checked."""

    @abstractmethod
    async def remove_prefix(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """Forgets blocks the replica is known to have evicted (best effort)."""

    @abstractmethod
    async def write_prefixes(
        self, replica_id: str, tiers: Mapping[BlockHash, str | None], ttl_s: float
    ) -> None:
        """Sets each block's record of the replica to its tier, or removes it (None), in one
        round trip (Redis: one pipeline). For a background writer that keeps what failed and
        retries: a failure raises AffinityStoreError but does not mark the store unavailable."""

    @abstractmethod
    async def clear_prefixes(self, replica_id: str) -> None:
        """Forgets every prefix record of the replica (its engine cleared or restarted)."""

    @abstractmethod
    async def longest_prefix_tiers(
        self, block_hashes: Sequence[BlockHash]
    ) -> dict[str, TierBlocks]:
        """For the chain `block_hashes` of one prompt: replica id -> its leading blocks (as
        `longest_prefix` counts them) split by tier as (device, cpu, disk, remote)."""

    @abstractmethod
    async def longest_prefix(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For the chain `block_hashes` of one prompt: replica id -> number of leading blocks held.

        A replica's value is `i + 1` for the largest `i` whose hash it holds; replicas holding
        none of the blocks are absent. Does not check that the replicas are alive.
        """

    # Lifecycle.

    @abstractmethod
    async def ping(self) -> None:
        """Raises AffinityStoreError unless the store answers."""

    @abstractmethod
    async def close(self) -> None:
        """Releases connections and background tasks; the store is unusable afterwards."""
