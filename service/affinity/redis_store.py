"""Redis affinity store (redis-py asyncio).

Keys, all under `key_prefix`:
    r:{replica_id}   hash   address, model_id, block_size, load fields, updated_at; PEXPIRE ttl
    replicas         zset   replica_id -> expiry (unix s); the index `list_replicas` reads
    s:{session_id}   string replica_id; PX ttl
    b:{hash hex}     zset   replica_id -> expiry (unix s); PEXPIRE ttl (refreshed on record)
    t:{hash hex}     hash   replica_id -> tier, for records not on the device (no field: device,
                            which is also what records written before tiers existed read as)
    p:{replica_id}   zset   block hash (raw bytes) -> expiry: the replica's records, for
                            `clear_prefixes`; trimmed on write

Per-member expiry lives in zset scores because Redis 7.0 has no per-field TTL; readers ignore
members whose score is in the past and writers trim them. Expiry compares the writer's and the
reader's wall clocks, so clocks must agree to well within the TTLs (NTP is plenty).

Failure handling: every call runs under `op_timeout_s` with no client-side retries. A connection
error or timeout marks the store unavailable; from then on calls fail fast with
`AffinityStoreError` (no added latency on the request path) while a background task pings Redis
every `reconnect_interval_s` and clears the mark once it answers. `write_prefixes` is the
exception: its caller (the replica agent's KV-event writer) keeps what failed and retries, so its
failures only raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import DataError, RedisError, ResponseError
from redis.typing import EncodableT, FieldT

from engine.kv.hashing import BlockHash
from service.affinity.base import (
    TIER_INDEX,
    AffinityStore,
    AffinityStoreError,
    ReplicaInfo,
    ReplicaLoad,
    ReplicaStatus,
    check_tier,
)
from service.affinity.prefix import TierBlocks, leading_tiers

log = logging.getLogger(__name__)

T = TypeVar("T")

_CLEAR_BATCH = 1024
"""Records removed per pipeline by `clear_prefixes` (each pipeline within op_timeout_s)."""
_ERRORS = (RedisError, OSError, TimeoutError)
"""What a call may raise; all but data errors (ResponseError, DataError) put the connection in
doubt and mark the store down. redis-py's ConnectionError and TimeoutError are RedisErrors;
asyncio.timeout raises the builtin TimeoutError."""


class RedisAffinityStore(AffinityStore):
    def __init__(
        self,
        url: str,
        key_prefix: str = "deja:",
        op_timeout_s: float = 0.25,
        connect_timeout_s: float = 0.25,
        max_connections: int = 32,
        reconnect_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._prefix = key_prefix.encode()
        self._op_timeout_s = op_timeout_s
        self._reconnect_interval_s = reconnect_interval_s
        self._clock = clock
        self._pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=op_timeout_s,
            socket_timeout=op_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._redis = Redis(connection_pool=self._pool)
        self._down_reason: str | None = None
        self._reconnect_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def available(self) -> bool:
        return self._down_reason is None and not self._closed

    # Plumbing.

    def _key(self, kind: bytes, name: str | bytes) -> bytes:
        return self._prefix + kind + (name.encode() if isinstance(name, str) else name)

    def _block_key(self, h: BlockHash) -> bytes:
        return self._prefix + b"b:" + h.hex().encode()

    def _tier_key(self, h: BlockHash) -> bytes:
        return self._prefix + b"t:" + h.hex().encode()

    async def _call(
        self, what: str, fn: Callable[[], Awaitable[T]], *, mark_down: bool = True
    ) -> T:
        if self._closed:
            raise AffinityStoreError("affinity store is closed")
        if self._down_reason is not None:
            raise AffinityStoreError(f"redis unavailable: {self._down_reason}")
        try:
            async with asyncio.timeout(self._op_timeout_s):
                return await fn()
        except _ERRORS as e:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # NOTE: a client library may turn our caller's cancellation into a connection
                # error; cancellation must win, or loops that are being stopped never stop.
                raise asyncio.CancelledError from e
            detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if mark_down and not isinstance(e, ResponseError | DataError):
                self._mark_down(f"{what}: {detail}")
            raise AffinityStoreError(f"redis {what} failed: {detail}") from e

    def _mark_down(self, reason: str) -> None:
        if self._down_reason is None:
            log.warning("affinity store unavailable (%s); reconnecting in the background", reason)
        self._down_reason = reason
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._reconnect_interval_s)
            try:
                # Drop idle connections that may point at a dead server before probing.
                await self._pool.disconnect(inuse_connections=False)
                async with asyncio.timeout(self._op_timeout_s):
                    await self._redis.ping()
            except _ERRORS as e:
                log.debug("redis still unavailable: %s", e)
                continue
            log.info("affinity store reconnected")
            self._down_reason = None
            return

    # Replica registry.

    async def register(self, info: ReplicaInfo, load: ReplicaLoad, ttl_s: float) -> None:
        now = self._clock()
        key = self._key(b"r:", info.replica_id)
        mapping: dict[FieldT, EncodableT] = {
            "address": info.address,
            "model_id": info.model_id,
            "block_size": info.block_size,
            "running": load.num_running,
            "waiting": load.num_waiting,
            "kv_usage": repr(float(load.kv_usage)),
            "hit_rate": repr(float(load.hit_rate)),
            "updated_at": repr(now),
        }

        async def run() -> None:
            pipe = self._redis.pipeline(transaction=True)
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, _ms(ttl_s))
            pipe.zadd(self._key(b"", "replicas"), {info.replica_id: now + ttl_s})
            await pipe.execute()

        await self._call("register", run)

    async def deregister(self, replica_id: str) -> None:
        async def run() -> None:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(self._key(b"r:", replica_id))
            pipe.zrem(self._key(b"", "replicas"), replica_id)
            await pipe.execute()

        await self._call("deregister", run)

    async def list_replicas(self) -> list[ReplicaStatus]:
        now = self._clock()
        index = self._key(b"", "replicas")

        async def run() -> list[ReplicaStatus]:
            pipe = self._redis.pipeline(transaction=False)
            pipe.zremrangebyscore(index, "-inf", now)
            pipe.zrange(index, 0, -1)
            _, ids = await pipe.execute()
            names = sorted(i.decode() for i in ids)
            if not names:
                return []
            pipe = self._redis.pipeline(transaction=False)
            for rid in names:
                pipe.hgetall(self._key(b"r:", rid))
            rows = await pipe.execute()
            return [s for rid, row in zip(names, rows, strict=True) if (s := _status(rid, row))]

        return await self._call("list_replicas", run)

    # Session affinity.

    async def set_session(self, session_id: str, replica_id: str, ttl_s: float) -> None:
        key = self._key(b"s:", session_id)

        async def run() -> None:
            await self._redis.set(key, replica_id, px=_ms(ttl_s))

        await self._call("set_session", run)

    async def get_session(self, session_id: str) -> str | None:
        key = self._key(b"s:", session_id)

        async def run() -> str | None:
            value = await self._redis.get(key)
            if value is None:
                return None
            return value.decode() if isinstance(value, bytes) else str(value)

        return await self._call("get_session", run)

    # Prefix records.

    async def _record_prefix(
        self, replica_id: str, block_hashes: Sequence[BlockHash], ttl_s: float, tier: str
    ) -> None:
        if not block_hashes:
            return
        now = self._clock()
        index = self._key(b"p:", replica_id)

        async def run() -> None:
            pipe = self._redis.pipeline(transaction=False)
            for h in block_hashes:
                self._pipe_record(pipe, replica_id, h, tier, now, ttl_s)
            pipe.zadd(index, {h: now + ttl_s for h in block_hashes})
            pipe.zremrangebyscore(index, "-inf", now)
            pipe.pexpire(index, _ms(ttl_s))
            await pipe.execute()

        await self._call("record_prefix", run)

    def _pipe_record(
        self, pipe: Pipeline, replica_id: str, h: BlockHash, tier: str, now: float, ttl_s: float
    ) -> None:
        key = self._block_key(h)
        pipe.zremrangebyscore(key, "-inf", now)
        pipe.zadd(key, {replica_id: now + ttl_s})
        pipe.pexpire(key, _ms(ttl_s))
        if tier == "device":
            pipe.hdel(self._tier_key(h), replica_id)
        else:
            pipe.hset(self._tier_key(h), replica_id, tier)
            pipe.pexpire(self._tier_key(h), _ms(ttl_s))

    async def write_prefixes(
        self, replica_id: str, tiers: Mapping[BlockHash, str | None], ttl_s: float
    ) -> None:
        if not tiers:
            return
        for tier in tiers.values():
            if tier is not None:
                check_tier(tier)
        now = self._clock()
        index = self._key(b"p:", replica_id)
        held = {h: now + ttl_s for h, tier in tiers.items() if tier is not None}
        gone = [h for h, tier in tiers.items() if tier is None]

        async def run() -> None:
            pipe = self._redis.pipeline(transaction=False)
            for h, tier in tiers.items():
                if tier is None:
                    pipe.zrem(self._block_key(h), replica_id)
                    pipe.hdel(self._tier_key(h), replica_id)
                else:
                    self._pipe_record(pipe, replica_id, h, tier, now, ttl_s)
            if held:
                pipe.zadd(index, held)
                pipe.pexpire(index, _ms(ttl_s))
            if gone:
                pipe.zrem(index, *gone)
            pipe.zremrangebyscore(index, "-inf", now)
            await pipe.execute()

        # NOTE: a background writer retries; one slow pipeline must not cut off the
        # registrations and sessions of this process for a reconnect interval.
        await self._call("write_prefixes", run, mark_down=False)

    async def remove_prefix(self, replica_id: str, block_hashes: Sequence[BlockHash]) -> None:
        if not block_hashes:
            return

        async def run() -> None:
            pipe = self._redis.pipeline(transaction=False)
            for h in block_hashes:
                pipe.zrem(self._block_key(h), replica_id)
                pipe.hdel(self._tier_key(h), replica_id)
            pipe.zrem(self._key(b"p:", replica_id), *block_hashes)
            await pipe.execute()

        await self._call("remove_prefix", run)

    async def clear_prefixes(self, replica_id: str) -> None:
        index = self._key(b"p:", replica_id)
        while True:

            async def run() -> int:
                raw = await self._redis.zrange(index, 0, _CLEAR_BATCH - 1)
                hashes = [h for h in raw if isinstance(h, bytes)]
                if not hashes:
                    return 0
                pipe = self._redis.pipeline(transaction=False)
                for h in hashes:
                    pipe.zrem(self._block_key(h), replica_id)
                    pipe.hdel(self._tier_key(h), replica_id)
                pipe.zrem(index, *hashes)
                await pipe.execute()
                return len(hashes)

            if await self._call("clear_prefixes", run) < _CLEAR_BATCH:
                return

    async def _holders(
        self, block_hashes: Sequence[BlockHash], now: float, *, with_tiers: bool
    ) -> list[Any]:
        """One round trip: each block's replicas whose hold is live at `now`, each followed by the
        block's replica -> tier hash when `with_tiers`."""
        pipe = self._redis.pipeline(transaction=False)
        for h in block_hashes:
            pipe.zrangebyscore(self._block_key(h), f"({now!r}", "+inf")
            if with_tiers:
                pipe.hgetall(self._tier_key(h))
        return await pipe.execute()

    async def longest_prefix_tiers(
        self, block_hashes: Sequence[BlockHash]
    ) -> dict[str, TierBlocks]:
        if not block_hashes:
            return {}
        now = self._clock()

        async def run() -> dict[str, TierBlocks]:
            rows = await self._holders(block_hashes, now, with_tiers=True)
            held: list[dict[str, int]] = []
            for i in range(0, len(rows), 2):
                tiers = {k.decode(): v.decode() for k, v in rows[i + 1].items()}
                rids = [r.decode() for r in rows[i]]
                held.append({rid: TIER_INDEX.get(tiers.get(rid, ""), 0) for rid in rids})
            return leading_tiers(held)

        return await self._call("longest_prefix_tiers", run)

    async def longest_prefix(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not block_hashes:
            return {}
        now = self._clock()

        async def run() -> dict[str, int]:
            holders: list[list[bytes]] = await self._holders(block_hashes, now, with_tiers=False)
            out: dict[str, int] = {}
            for i in range(len(holders) - 1, -1, -1):
                for rid in holders[i]:
                    out.setdefault(rid.decode(), i + 1)
            return out

        return await self._call("longest_prefix", run)

    # Lifecycle.

    async def ping(self) -> None:
        async def run() -> None:
            await self._redis.ping()

        await self._call("ping", run)

    async def close(self) -> None:
        self._closed = True
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconnect_task
        try:
            await self._redis.aclose()
            await self._pool.disconnect()
        except (RedisError, OSError) as e:
            log.debug("closing redis: %s", e)


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _status(replica_id: str, row: dict[bytes, bytes]) -> ReplicaStatus | None:
    """Parses one registration hash; None when it expired between the two reads or is malformed."""
    if not row:
        return None
    try:
        f = {k.decode(): v.decode() for k, v in row.items()}
        info = ReplicaInfo(replica_id, f["address"], f["model_id"], int(f["block_size"]))
        load = ReplicaLoad(
            num_running=int(f["running"]),
            num_waiting=int(f["waiting"]),
            kv_usage=float(f["kv_usage"]),
            hit_rate=float(f["hit_rate"]),
        )
        return ReplicaStatus(info, load, float(f["updated_at"]))
    except (KeyError, ValueError) as e:
        log.warning("ignoring malformed registration of %s: %s", replica_id, e)
        return None
