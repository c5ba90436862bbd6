"""What a replica started with --redis-url runs: registration, heartbeat, load, affinity records.

`ReplicaAgent.start()` registers the replica and heartbeats every `heartbeat_s` with its current
load (from `get_stats()`); `record()` is called after each finished Generate and writes, in the
background, `session_id -> this replica`.

Prefix records from KV events (`kv_events`, what `deja serve` passes: the replica's event ring,
service/replica/kv_events.py): the agent subscribes from 0, so it first gets a snapshot, and
hands every batch to its `KvRecordWriter` (service/replica/kv_records.py): a block stored in a
tier is recorded with the best tier that holds it (device, then cpu, then disk), a block no tier
holds any more is removed, and AllBlocksCleared drops every record of this replica
(`clear_prefixes`) before the snapshot that follows republishes them. After a restart the stale
records of the replica's previous life are therefore gone once the first snapshot is applied.
The writer applies batches in memory and writes the netted changes in its own task at most every
`prefix_flush_s`, retrying what failed, so the store sees a few writes a second whatever the
step rate, and a slow or failed write never holds up the heartbeat (its own task) or the event
stream. Held records are re-recorded every `prefix_ttl_s / 2` so they do not expire. The agent
resubscribes from 0 (a fresh snapshot) only when applying events failed.

Without `kv_events` (the cluster simulator, bench/sim/), `record()` also writes the prompt's block
hashes (the engine's own chain, bounded per request) and the agent keeps a local LRU of them,
sized like the replica's KV tiers; a hash pushed out of it has most likely been evicted by the
engine too, so its record is removed (an estimate). Given the engine's `cached_block_hashes`,
`start()` then also republishes the block hashes the engine already holds.

The store is an optimisation: every failure is logged (rate limited) and counted in
`deja_affinity_store_errors_total`, and never reaches a request.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter

from engine.frontend.prompt import prompt_block_hashes
from engine.kv.hashing import BlockHash
from engine.stats import EngineStats, ModelInfo
from service.affinity.base import (
    AffinityStore,
    AffinityStoreError,
    ReplicaInfo,
    ReplicaLoad,
)
from service.affinity.config import AffinityConfig
from service.affinity.flags import add_affinity_args, affinity_config_from_args
from service.affinity.prefix import REMOTE_HOLDER, bounded_chain
from service.common.flags import add_flag
from service.replica.kv_events import KvBatch
from service.replica.kv_records import KvRecordWriter

log = logging.getLogger(__name__)

_MAX_PENDING_RECORDS = 256
"""Records waiting for the store beyond this are dropped (counted), so memory stays bounded."""
_LOG_EVERY_S = 10.0
_REPUBLISH_BATCH = 1024
"""Hashes per record_prefix call when republishing."""
_REPUBLISH_TIMEOUT_S = 30.0

CachedHashes = Callable[[int], Awaitable[list[BlockHash]]]
"""`limit -> the engine's cached block hashes, most recently used first` (AsyncEngine's)."""
KvEventSource = Callable[[int], AsyncIterator[KvBatch]]
"""`start_sequence_number -> the replica's KV-event batches` (KvEventRing.subscribe)."""
_RESUBSCRIBE_PAUSE_S = 1.0


def load_from_stats(stats: EngineStats) -> ReplicaLoad:
    return ReplicaLoad(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_usage=stats.kv_usage,
        hit_rate=stats.prefix_hit_rate,
    )


def cache_capacity_blocks(num_device_blocks: int, stats: EngineStats) -> int:
    """Blocks the replica can keep cached over its device and host tiers (not disk)."""
    cpu = sum(t.num_blocks for t in stats.tiers if t.name == "cpu")
    return num_device_blocks + cpu


class ReplicaAgent:
    def __init__(
        self,
        store: AffinityStore,
        info: ReplicaInfo,
        get_stats: Callable[[], EngineStats],
        config: AffinityConfig,
        *,
        capacity_blocks: int,
        registry: CollectorRegistry | None = None,
        cached_hashes: CachedHashes | None = None,
        kv_events: KvEventSource | None = None,
    ) -> None:
        self.store = store
        self._cached_hashes = cached_hashes
        self._kv_events = kv_events
        self.kv_records = KvRecordWriter(
            store,
            info.replica_id,
            self._try,
            ttl_s=config.prefix_ttl_s,
            flush_s=config.prefix_flush_s,
            retry_s=config.reconnect_interval_s,
        )
        """The prefix records of KV events (used with `kv_events` only)."""
        self.remote_records = KvRecordWriter(
            store,
            REMOTE_HOLDER,
            self._try,
            ttl_s=config.prefix_ttl_s,
            flush_s=config.prefix_flush_s,
            retry_s=config.reconnect_interval_s,
            media=frozenset({"remote"}),
            shared=True,
        )
        """The remote tier's records, shared by every replica (written only with a remote tier)."""
        self._followers: list[asyncio.Task[None]] = []
        self.info = info
        self._get_stats = get_stats
        self._config = config
        self._capacity = max(1, capacity_blocks)
        self._held: OrderedDict[BlockHash, None] = OrderedDict()
        """Hashes recorded for this replica, least recently recorded first."""
        self._pending: set[asyncio.Task[bool] | asyncio.Task[int]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._last_log = 0.0
        self._stopping = False
        self.errors = Counter(
            "deja_affinity_store_errors",
            "Affinity store calls that failed (the request went on without them).",
            ["op"],
            registry=registry,
        )
        self.records = Counter(
            "deja_affinity_records",
            "Affinity records written after requests, by result.",
            ["result"],
            registry=registry,
        )

    # Lifecycle.

    async def start(self) -> None:
        """Registers now (a failure is only logged) and starts the heartbeat loop."""
        await self.heartbeat_once()
        loop = asyncio.get_running_loop()
        self._heartbeat = loop.create_task(self._heartbeat_loop())
        if self._kv_events is not None:
            self._followers = [
                loop.create_task(self._follow_events()),
                loop.create_task(self.kv_records.run()),
                loop.create_task(self.remote_records.run()),
                loop.create_task(self._refresh_loop()),
            ]
        elif self._cached_hashes is not None:
            task = loop.create_task(self.republish())
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def republish(self) -> int:
        """Records the prefixes the engine holds now (its tiers, disk index included) for this
        replica; returns how many hashes the store took. Never raises."""
        if self._cached_hashes is None:
            return 0
        try:
            hashes = await asyncio.wait_for(
                self._cached_hashes(self._capacity), timeout=_REPUBLISH_TIMEOUT_S
            )
        except Exception as e:  # the engine is an optimisation's source here, never fatal
            log.warning("cannot list the engine's cached blocks to republish: %r", e)
            return 0
        # least recently used first into the local LRU, so the hottest are evicted last
        self._touch(list(reversed(hashes)))
        n = 0
        for i in range(0, len(hashes), _REPUBLISH_BATCH):
            chunk = hashes[i : i + _REPUBLISH_BATCH]
            ok = await self._try(
                "record_prefix",
                self.store.record_prefix(self.info.replica_id, chunk, self._config.prefix_ttl_s),
            )
            n += len(chunk) if ok else 0
        self.records.labels("republished" if n else "failed").inc()
        if hashes:
            log.info("republished %d of %d cached block hashes", n, len(hashes))
        return n

    async def stop(self, deregister: bool = True) -> None:
        """Stops heartbeating, waits briefly for pending records, deregisters, closes the store."""
        self._stopping = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.wait([self._heartbeat], timeout=2.0)
            self._heartbeat = None
        for task in self._followers:
            task.cancel()
        if self._followers:
            await asyncio.wait(self._followers, timeout=2.0)
        self._followers = []
        await self.flush(timeout_s=1.0)
        if deregister:
            await self._try("deregister", self.store.deregister(self.info.replica_id))
        await self.store.close()

    async def heartbeat_once(self) -> bool:
        try:
            load = load_from_stats(self._get_stats())
        except Exception as e:
            log.debug("get_stats failed: %s", e)
            load = ReplicaLoad()
        return await self._try(
            "register", self.store.register(self.info, load, self._config.replica_ttl_s)
        )

    async def _heartbeat_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self._config.heartbeat_s)
            await self.heartbeat_once()

    # Records.

    def record(
        self, session_id: str, prompt_token_ids: Sequence[int], cache_salt: str | None
    ) -> None:
        """Records affinity for a finished request in the background; never raises or blocks."""
        if len(self._pending) >= _MAX_PENDING_RECORDS:
            self.records.labels("dropped").inc()
            return
        try:
            task = asyncio.get_running_loop().create_task(
                self.record_now(session_id, prompt_token_ids, cache_salt)
            )
        except RuntimeError:  # no running loop: nothing to do it on
            self.records.labels("dropped").inc()
            return
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def record_now(
        self, session_id: str, prompt_token_ids: Sequence[int], cache_salt: str | None
    ) -> bool:
        """Writes the session and prefix records; True when the store took them."""
        ok = True
        if session_id:
            ok &= await self._try(
                "set_session",
                self.store.set_session(
                    session_id, self.info.replica_id, self._config.session_ttl_s
                ),
            )
        hashes = prompt_block_hashes(
            prompt_token_ids, self.info.block_size, self.info.model_id, cache_salt
        )
        if hashes and self._kv_events is None:  # with events, the engine says what it holds
            chain = bounded_chain(hashes, self._config.max_blocks_per_record)
            ok &= await self._try(
                "record_prefix",
                self.store.record_prefix(self.info.replica_id, chain, self._config.prefix_ttl_s),
            )
            evicted = self._touch(chain)
            if evicted:
                ok &= await self._try(
                    "remove_prefix", self.store.remove_prefix(self.info.replica_id, evicted)
                )
        self.records.labels("ok" if ok else "failed").inc()
        return ok

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Waits for records scheduled so far (tests, shutdown)."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=timeout_s)

    # KV events.

    async def _follow_events(self) -> None:
        """Hands the replica's KV-event batches to the record writer, from a snapshot on;
        resubscribes from 0 (a new snapshot) when applying one failed."""
        assert self._kv_events is not None
        while not self._stopping:
            batches = self._kv_events(0)
            try:
                async for batch in batches:
                    self.kv_records.apply(batch)
                    self.remote_records.apply(batch)
                else:
                    return  # the ring was closed: the replica is stopping
            except Exception:
                log.exception("applying KV events failed; resubscribing")
            finally:
                await batches.aclose()  # type: ignore[attr-defined]
            await asyncio.sleep(_RESUBSCRIBE_PAUSE_S)

    async def _refresh_loop(self) -> None:
        """Re-records every held hash before its record expires."""
        while not self._stopping:
            await asyncio.sleep(self._config.prefix_ttl_s / 2)
            self.kv_records.refresh()
            self.remote_records.refresh()

    def _touch(self, chain: Sequence[BlockHash]) -> list[BlockHash]:
        """Marks the chain most recently used; returns the hashes pushed out of the local LRU."""
        for h in chain:
            self._held[h] = None
            self._held.move_to_end(h)
        evicted: list[BlockHash] = []
        while len(self._held) > self._capacity:
            evicted.append(self._held.popitem(last=False)[0])
        return evicted

    async def _try(self, op: str, call: Awaitable[None]) -> bool:
        try:
            await call
            return True
        except AffinityStoreError as e:
            self.errors.labels(op).inc()
            now = time.monotonic()
            if now - self._last_log >= _LOG_EVERY_S:
                self._last_log = now
                log.warning("affinity store %s failed (requests are unaffected): %s", op, e)
            return False


# -- wiring into `deja serve` --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgentSettings:
    affinity: AffinityConfig
    advertise_address: str | None = None
    """host:port routers reach this replica at; None: --host (or the hostname) and the port."""


def add_replica_agent_args(parser: argparse.ArgumentParser) -> None:
    """`deja serve` flags of the agent (the command has --redis-url already)."""
    add_affinity_args(parser, with_url=False)
    add_flag(
        parser,
        "--advertise-address",
        help="host:port routers use to reach this replica (default: --host or the hostname, "
        "and the bound port).",
    )
    add_flag(
        parser,
        "--kv-event-flush",
        type=float,
        default=AffinityConfig().prefix_flush_s,
        help="Write the prefix changes of KV events at most this often (s).",
    )


def agent_settings_from_args(args: argparse.Namespace) -> AgentSettings:
    affinity = replace(affinity_config_from_args(args), prefix_flush_s=args.kv_event_flush)
    return AgentSettings(affinity, args.advertise_address or None)


def advertised_address(settings: AgentSettings, host: str, port: int) -> str:
    if settings.advertise_address:
        return settings.advertise_address
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


async def start_replica_agent(
    settings: AgentSettings,
    *,
    replica_id: str,
    host: str,
    port: int,
    model_info: ModelInfo,
    get_stats: Callable[[], EngineStats],
    registry: CollectorRegistry | None = None,
    cached_hashes: CachedHashes | None = None,
    kv_events: KvEventSource | None = None,
) -> ReplicaAgent:
    """Builds the store and the agent of one replica and starts heartbeating (never raises for
    an unreachable store: the heartbeat keeps trying)."""
    from service.affinity.factory import create_store

    info = ReplicaInfo(
        replica_id,
        advertised_address(settings, host, port),
        model_info.model_id,
        model_info.block_size,
    )
    agent = ReplicaAgent(
        create_store(settings.affinity),
        info,
        get_stats,
        settings.affinity,
        capacity_blocks=cache_capacity_blocks(model_info.num_device_blocks, get_stats()),
        registry=registry,
        cached_hashes=cached_hashes,
        kv_events=kv_events,
    )
    await agent.start()
    log.info("registered as %s at %s (%s)", replica_id, info.address, settings.affinity.redis_url)
    return agent
