"""In-memory affinity store: the default when no Redis URL is given (one process sees it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from engine.kv.hashing import BlockHash
from service.affinity.base import (
    TIER_INDEX,
    AffinityStore,
    AffinityStoreError,
    ReplicaInfo,
    ReplicaLoad,
    ReplicaStatus,
)
from service.affinity.prefix import TierBlocks, leading_tiers


class MemoryAffinityStore(AffinityStore):
    """Dicts with expiry times. `clock` is injectable so tests can move time.

    Expired entries are dropped lazily when read, and prefix entries also in a sweep every
    `sweep_every` writes, so memory stays bounded by what is live.
    """

    def __init__(self, clock: Callable[[], float] = time.time, sweep_every: int = 1024) -> None:
        self._clock = clock
        self._replicas: dict[str, tuple[ReplicaStatus, float]] = {}
        self._sessions: dict[str, tuple[str, float]] = {}
        self._blocks: dict[BlockHash, dict[str, tuple[float, int]]] = {}
        """block hash -> replica id -> (expiry time, tier index)."""
        self._by_replica: dict[str, set[BlockHash]] = {}
        """replica id -> the hashes it has records of (what `clear_prefixes` drops)."""
        self._writes = 0
        self._sweep_every = sweep_every
        self._closed = False

    @property
    def available(self) -> bool:
        return not self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise AffinityStoreError("affinity store is closed")

    async def register(self, info: ReplicaInfo, load: ReplicaLoad, ttl_s: float) -> None:
        self._check_open()
        now = self._clock()
        self._replicas[info.replica_id] = (ReplicaStatus(info, load, now), now + ttl_s)

    async def deregister(self, replica_id: str) -> None:
        self._check_open()
        self._replicas.pop(replica_id, None)

    async def list_replicas(self) -> list[ReplicaStatus]:
        self._check_open()
        now = self._clock()
        for rid in [r for r, (_, exp) in self._replicas.items() if exp <= now]:
            del self._replicas[rid]
        return [self._replicas[rid][0] for rid in sorted(self._replicas)]

    async def set_session(self, session_id: str, replica_id: str, ttl_s: float) -> None:
        self._check_open()
        self._sessions[session_id] = (replica_id, self._clock() + ttl_s)
        self._count_write()

    async def get_session(self, session_id: str) -> str | None:
        self._check_open()
        entry = self._sessions.get(session_id)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            del self._sessions[session_id]
            return None
        return entry[0]

    async def _record_prefix(
        self, replica_id: str, block_hashes: Sequence[BlockHash], ttl_s: float, tier: str
    ) -> None:
        self._check_open()
        entry = (self._clock() + ttl_s, TIER_INDEX[tier])
        mine = self._by_replica.setdefault(replica_id, set())
        for h in block_hashes:
            self._blocks.setdefault(h, {})[replica_id] = entry
            mine.add(h)
        self._count_write()

    async def remove_prefix(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> None:
        self._check_open()
        self._forget(replica_id, block_hashes)

    def _forget(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> None:
        mine = self._by_replica.get(replica_id, set())
        for h in block_hashes:
            mine.discard(h)
            holders = self._blocks.get(h)
            if holders is not None:
                holders.pop(replica_id, None)
                if not holders:
                    del self._blocks[h]

    async def write_prefixes(
        self, replica_id: str, tiers: Mapping[BlockHash, str | None], ttl_s: float
    ) -> None:
        self._check_open()
        expiry = self._clock() + ttl_s
        mine = self._by_replica.setdefault(replica_id, set())
        for h, tier in tiers.items():
            if tier is not None:
                self._blocks.setdefault(h, {})[replica_id] = (expiry, TIER_INDEX[tier])
                mine.add(h)
        self._forget(replica_id, [h for h, tier in tiers.items() if tier is None])
        self._count_write()

    async def clear_prefixes(self, replica_id: str) -> None:
        self._check_open()
        self._forget(replica_id, list(self._by_replica.pop(replica_id, ())))

    async def longest_prefix_tiers(
        self, block_hashes: Sequence[BlockHash]
    ) -> dict[str, TierBlocks]:
        self._check_open()
        now = self._clock()
        held = [
            {rid: t for rid, (exp, t) in self._blocks.get(h, {}).items() if exp > now}
            for h in block_hashes
        ]
        return leading_tiers(held)

    async def longest_prefix(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        self._check_open()
        now = self._clock()
        out: dict[str, int] = {}
        # NOTE: walk from the tail so each replica's first sighting is its longest prefix.
        for i in range(len(block_hashes) - 1, -1, -1):
            holders = self._blocks.get(block_hashes[i])
            if not holders:
                continue
            for rid, (expiry, _) in holders.items():
                if expiry > now and rid not in out:
                    out[rid] = i + 1
        return out

    async def ping(self) -> None:
        self._check_open()

    async def close(self) -> None:
        self._closed = True
        self._replicas.clear()
        self._sessions.clear()
        self._blocks.clear()
        self._by_replica.clear()

    def _count_write(self) -> None:
        self._writes += 1
        if self._writes % self._sweep_every == 0:
            self._sweep()

    def _sweep(self) -> None:
        now = self._clock()
        for sid in [s for s, (_, exp) in self._sessions.items() if exp <= now]:
            del self._sessions[sid]
        for h in list(self._blocks):
            holders = {rid: e for rid, e in self._blocks[h].items() if e[0] > now}
            for rid in self._blocks[h].keys() - holders.keys():
                self._by_replica.get(rid, set()).discard(h)
            if holders:
                self._blocks[h] = holders
            else:
                del self._blocks[h]
