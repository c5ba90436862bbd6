"""The replicas a router can send to: membership, health, load and open streams.

Membership is the static `--replicas` list plus, with discovery on, the store's registry. A
discovered replica that leaves the registry stays a member for one registration TTL more, and
nothing is dropped while the store is unreachable: routing then goes on over the replicas last
known healthy. Health and load come from polling each member's GetLoad every `poll_interval_s`:
a refused connection (UNAVAILABLE) or a draining replica is down at once, timeouts only after
`poll_failures_down` in a row (a busy CPU replica may answer slowly). A Generate call that gets
UNAVAILABLE marks its replica down until the next successful poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from service.affinity.base import AffinityStore, AffinityStoreError
from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from service.router.config import RouterConfig
from service.router.metrics import RouterMetrics
from service.router.policy import Candidate

log = logging.getLogger(__name__)

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


@dataclass(slots=True)
class ReplicaHandle:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.InferenceStub
    static: bool
    replica_id: str | None = None
    """Learned from the registry or the first successful poll."""
    model_id: str | None = None
    block_size: int | None = None
    load: pb.Load = field(default_factory=pb.Load)
    healthy: bool = False
    poll_failures: int = 0
    inflight: int = 0
    """Generate streams this router has open to the replica."""
    pending_prefill_tokens: int = 0
    """Uncached prompt tokens of those streams that have not produced a first token yet."""
    pending_requests: int = 0
    """Those streams."""
    last_listed: float = 0.0
    """time.monotonic() of the last registry listing that named this replica."""

    def add_pending(self, uncached_tokens: int) -> None:
        """A stream sent here that has no first token yet (`end_pending` when it has one or
        ends)."""
        self.pending_prefill_tokens += uncached_tokens
        self.pending_requests += 1

    def end_pending(self, uncached_tokens: int) -> None:
        self.pending_prefill_tokens -= uncached_tokens
        self.pending_requests -= 1

    def candidate(self) -> Candidate:
        assert self.replica_id is not None
        return Candidate(
            self.replica_id,
            running=self.load.running,
            waiting=self.load.waiting,
            kv_usage=self.load.kv_usage,
            inflight=self.inflight,
            queued_prefill_tokens=self.load.queued_prefill_tokens,
            pending_prefill_tokens=self.pending_prefill_tokens,
            pending_requests=self.pending_requests,
            decoding=self.load.decoding,
            active_tokens=self.load.active_tokens,
            prefill_tokens_per_s=self.load.prefill_tokens_per_s,
            decode_seq_s=self.load.decode_seq_s,
            step_tokens=self.load.step_tokens,
            utilisation=self.load.utilisation,
            block_size=self.block_size or 16,
        )


class ReplicaPool:
    def __init__(
        self,
        config: RouterConfig,
        store: AffinityStore,
        metrics: RouterMetrics,
        call_metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        self._config = config
        self._store = store
        self._metrics = metrics
        self._call_metadata = tuple(call_metadata)
        """Sent with the router's own calls (polls): the bearer token when replicas use auth."""
        self._handles: dict[str, ReplicaHandle] = {}
        """address -> handle."""
        self._task: asyncio.Task[None] | None = None
        self._listing_since: float | None = None
        """time.monotonic() since which registry listings have succeeded without a break."""
        for address in config.replicas:
            self._handles[address] = self._new_handle(address, static=True)

    def _new_handle(self, address: str, *, static: bool) -> ReplicaHandle:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return ReplicaHandle(address, channel, pb_grpc.InferenceStub(channel), static)

    # Lifecycle.

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(h.channel.close() for h in self._handles.values()))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.poll_interval_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("refreshing replicas failed")

    # Views.

    def handles(self) -> list[ReplicaHandle]:
        return list(self._handles.values())

    def healthy(self, exclude: set[str] | frozenset[str] = frozenset()) -> list[ReplicaHandle]:
        """Healthy replicas with a known id, one handle per id, minus `exclude` (ids)."""
        out: dict[str, ReplicaHandle] = {}
        for h in self._handles.values():
            if h.healthy and h.replica_id is not None and h.replica_id not in exclude:
                out.setdefault(h.replica_id, h)
        return [out[rid] for rid in sorted(out)]

    def by_id(self, replica_id: str) -> ReplicaHandle | None:
        for h in self._handles.values():
            if h.replica_id == replica_id:
                return h
        return None

    def mark_down(self, handle: ReplicaHandle, reason: str) -> None:
        if handle.healthy:
            log.warning("replica %s (%s) is down: %s", handle.replica_id, handle.address, reason)
        handle.healthy = False
        self._update_gauges()

    # Refresh.

    async def refresh(self) -> None:
        """One round: membership from the registry (if on), then a poll of every member."""
        if self._config.discover and self._config.affinity.redis_url is not None:
            await self._discover()
        await asyncio.gather(*(self._poll(h) for h in list(self._handles.values())))
        self._update_gauges()

    async def _discover(self) -> None:
        try:
            listed = await self._store.list_replicas()
        except AffinityStoreError as e:
            self._metrics.store_errors.labels("list_replicas").inc()
            log.debug("registry unavailable, keeping the replicas last known: %s", e)
            self._listing_since = None
            return
        now = time.monotonic()
        if self._listing_since is None:
            self._listing_since = now
        for status in listed:
            info = status.info
            h = self._handles.get(info.address)
            if h is None:
                log.info("discovered replica %s at %s", info.replica_id, info.address)
                h = self._handles[info.address] = self._new_handle(info.address, static=False)
            h.last_listed = now
            h.replica_id = info.replica_id
            h.model_id = info.model_id
            h.block_size = info.block_size
        grace = self._config.affinity.replica_ttl_s
        for address, h in list(self._handles.items()):
            # NOTE: after an outage (a restarted, empty Redis) replicas need a heartbeat to
            # re-register; each gets a full TTL from the first good listing before it is dropped.
            if not h.static and now - max(h.last_listed, self._listing_since) > grace:
                log.info("replica %s at %s left the registry", h.replica_id, address)
                del self._handles[address]
                await h.channel.close()

    async def _poll(self, h: ReplicaHandle) -> None:
        timeout = self._config.poll_timeout_s
        md = self._call_metadata or None
        try:
            load = await h.stub.GetLoad(pb.GetLoadRequest(), timeout=timeout, metadata=md)
            if h.model_id is None or h.block_size is None or h.replica_id != load.replica_id:
                info = await h.stub.GetModelInfo(
                    pb.GetModelInfoRequest(), timeout=timeout, metadata=md
                )
                h.model_id, h.block_size = info.model_id, info.block_size
        except grpc.aio.AioRpcError as e:
            h.poll_failures += 1
            refused = e.code() == grpc.StatusCode.UNAVAILABLE
            if h.healthy and (refused or h.poll_failures >= self._config.poll_failures_down):
                self.mark_down(h, f"GetLoad: {e.code().name}: {e.details()}")
            return
        if h.replica_id is not None and h.replica_id != load.replica_id:
            log.warning("address %s now serves replica %s", h.address, load.replica_id)
        h.replica_id = load.replica_id
        h.load = load
        h.poll_failures = 0
        if load.draining:
            self.mark_down(h, "draining")
        elif not h.healthy:
            log.info("replica %s (%s) is healthy", h.replica_id, h.address)
            h.healthy = True

    def _update_gauges(self) -> None:
        healthy = sum(1 for h in self._handles.values() if h.healthy)
        self._metrics.replicas.labels("healthy").set(healthy)
        self._metrics.replicas.labels("known").set(len(self._handles))
