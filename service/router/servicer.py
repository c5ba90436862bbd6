"""The router's servicer: the replicas' public deja.v1.Inference API, in front of them (the
process around it, with health, reflection and metrics, is service/router/server.py).

Generate: pick a replica (service/router/policy.py over the healthy replicas of
service/router/pool.py, with the session and prefix records of the affinity store), proxy the
stream with the caller's deadline and metadata (bearer token; the W3C trace context becomes the
router span's), and retry on the next-best replica not tried yet when one fails before the first
message (UNAVAILABLE, its engine core died, its queue is full: service/router/retry.py); never
after it. The final message carries `route {replica_id, reason}`; before it is relayed the router
records `session -> replica` and the prompt's block hashes, so the next turn finds them.
Cancelling the call cancels the upstream call. The store is an optimisation: when it fails,
routing falls back to rendezvous hashing (reason "fallback", deja_router_fallback_total) and
no request fails because of it. Tokenize and GetModelInfo go to the least loaded healthy
replica; GetLoad and GetCacheStats add up the healthy replicas; Abort goes to every one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode

from service.affinity.base import AffinityStore, AffinityStoreError
from service.affinity.prefix import TierBlocks, bounded_chain, with_shared_tier
from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc
from service.common.rpc import SERVICE_NAME, abort
from service.common.tracing import extract_context, get_tracer
from service.router.config import RouterConfig
from service.router.metrics import RouterMetrics
from service.router.policy import Candidate, NoReplicaError, RouteDecision, RouteInputs, decide
from service.router.pool import ReplicaHandle, ReplicaPool
from service.router.popularity import PrefixPopularity
from service.router.prompt import PromptChains, PromptHasher
from service.router.retry import replica_is_down, retry_reason

log = logging.getLogger(__name__)

_DROP_METADATA = ("user-agent", "content-type", "te", "host", "traceparent", "tracestate")
"""Never forwarded (transport headers; trace context is re-injected when tracing is on)."""
T = TypeVar("T")


def forward_metadata(
    metadata: Sequence[tuple[str, Any]], span: trace.Span | None
) -> list[tuple[str, Any]]:
    """The caller's metadata for the upstream call, with the router span as trace parent."""
    out = [
        (k, v)
        for k, v in metadata
        if not k.startswith((":", "grpc-")) and k.lower() not in _DROP_METADATA
    ]
    if span is not None and span.get_span_context().is_valid:
        from service.common.tracing import inject_context

        inject_context(span, out)
    else:  # tracing off here: pass the caller's context through unchanged
        out += [(k, v) for k, v in metadata if k.lower() in ("traceparent", "tracestate")]
    return out


def _forward(
    h: ReplicaHandle,
    method: str,
    request: Any,
    timeout: float | None,
    metadata: list[tuple[str, Any]],
) -> Awaitable[Any]:
    """The unary call `method` of replica h's stub with `request`, the caller's deadline and
    metadata."""
    return getattr(h.stub, method)(request, timeout=timeout, metadata=metadata)


def _sum_by_name(into: dict[str, Any], items: Iterable[Any], message: Any) -> None:
    """Adds each named stats message (of class `message`) field by field into the one of its
    name in `into`."""
    for item in items:
        acc = into.setdefault(item.name, message(name=item.name))
        for f in message.DESCRIPTOR.fields:
            if f.message_type is not None:  # a map of counts by key (TierStats.misses)
                for k, v in getattr(item, f.name).items():
                    getattr(acc, f.name)[k] += v
            elif f.name != "name":
                setattr(acc, f.name, getattr(acc, f.name) + getattr(item, f.name))


@dataclass(slots=True)
class _Routed:
    """One Generate call through the router: its routing state, outcome and span."""

    request: pb.GenerateRequest
    key: str
    """Session id, else request id: the rendezvous and tie-break key."""
    span: trace.Span
    metadata: list[tuple[str, Any]]
    """What is forwarded upstream (service/router/servicer.forward_metadata)."""
    prompt: PromptChains
    t0: float
    exclude: set[str] = field(default_factory=set)
    """Replicas tried by an earlier attempt (each one is tried at most once)."""
    decision: RouteDecision | None = None
    got_first: bool = False
    """The current attempt relayed a message (no retry after that)."""
    outcome: str = "CANCELLED"
    """ok or a status name (the `outcome` label of deja_router_requests_total)."""


class RouterServicer(pb_grpc.InferenceServicer):
    def __init__(
        self,
        config: RouterConfig,
        pool: ReplicaPool,
        store: AffinityStore,
        hasher: PromptHasher,
        metrics: RouterMetrics,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._store = store
        self._hasher = hasher
        self._metrics = metrics
        self._tracer = get_tracer(tracer_provider)
        self._rr = itertools.count()
        self._popularity = PrefixPopularity()  # traffic shares for the cost policy's holders
        self.inflight = 0
        self.draining = False

    # -- routing -------------------------------------------------------------------------------

    async def _store_call(self, op: str, call: Awaitable[T]) -> tuple[bool, T | None]:
        try:
            return True, await call
        except AffinityStoreError as e:
            self._metrics.store_errors.labels(op).inc()
            log.debug("affinity store %s failed: %s", op, e)
            return False, None

    async def route(
        self, request: pb.GenerateRequest, key: str, prompt: PromptChains, exclude: set[str]
    ) -> tuple[RouteDecision, ReplicaHandle]:
        """Picks a healthy replica and counts the stream on it; raises NoReplicaError."""
        cfg = self._config
        if not self._pool.healthy(exclude):
            raise NoReplicaError("no healthy replica")
        inputs = RouteInputs(key)
        if cfg.policy != "round_robin":
            inputs = await self.lookup(request, key, prompt, exclude)
        # NOTE: read the candidates' loads after the awaits and count the stream before the next
        # await, so concurrent arrivals see each other's choices.
        healthy = self._pool.healthy(exclude)
        if not healthy:
            raise NoReplicaError("no healthy replica")
        candidates = [h.candidate() for h in healthy]
        decision = decide(cfg.policy, candidates, inputs, cfg.guard, next(self._rr), cfg.cost)
        if decision.reason == "fallback":
            self._metrics.fallback.inc()
        handle = self._pool.by_id(decision.replica_id)
        assert handle is not None
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "route %s -> %s (%s) est %.3fs uncached %d prompt %d | %s",
                key, decision.replica_id, decision.reason, decision.est_ttft_s,
                decision.uncached_tokens, inputs.prompt_tokens,
                " ".join(_describe(c) for c in candidates),
            )  # fmt: skip
        handle.inflight += 1
        handle.add_pending(decision.uncached_tokens)
        return decision, handle

    async def lookup(
        self, request: pb.GenerateRequest, key: str, prompt: PromptChains, exclude: set[str]
    ) -> RouteInputs:
        """What the store knows of this request: its session's replica and, per replica, the
        leading prompt blocks held in each tier, the shared one's counted for every replica
        (skipped when the session's replica decides alone, as under affinity)."""
        cfg = self._config
        store_ok, session_replica, prompt_tokens = True, None, 0
        prefix: dict[str, int] | None = None
        tiers: dict[str, TierBlocks] | None = None
        if cfg.policy in ("affinity", "cost") and request.session_id:
            store_ok, session_replica = await self._store_call(
                "get_session", self._store.get_session(request.session_id)
            )
        own = self._pool.by_id(session_replica) if session_replica else None
        sticky = own is not None and own.healthy and not cfg.guard.overloaded(own.candidate())
        if cfg.policy == "cost":
            sticky = False  # the session counts only through what its replica holds
            prompt_tokens = await prompt.num_tokens()
        shares = None
        if store_ok and not sticky:
            prefix, tiers = {}, {}
            groups: dict[tuple[str, int], list[str]] = {}
            for h in self._pool.healthy(exclude):
                if h.model_id is not None and h.block_size is not None and h.replica_id:
                    groups.setdefault((h.model_id, h.block_size), []).append(h.replica_id)
            for (model_id, block_size), ids in groups.items():
                chain = await prompt.chain(model_id, block_size)
                if not chain:
                    continue
                if shares is None and cfg.policy == "cost" and cfg.cost.holder_share > 0:
                    shares = self._popularity.track(chain, time.monotonic())
                ok, held = await self._store_call(
                    "longest_prefix", self._store.longest_prefix_tiers(chain)
                )
                store_ok &= ok
                tiers.update(with_shared_tier(held or {}, ids))
            prefix = {rid: sum(t) for rid, t in tiers.items()}
        return RouteInputs(key, session_replica, prefix, store_ok, prompt_tokens, tiers, shares)

    async def record(
        self, request: pb.GenerateRequest, replica_id: str, prompt: PromptChains
    ) -> None:
        """Writes session affinity and the prompt's blocks for the replica (before the final
        message is relayed, so the session's next turn sees them)."""
        cfg = self._config
        if cfg.policy == "round_robin" or not self._store.available:
            return
        h = self._pool.by_id(replica_id)
        chain = []
        if h is not None and h.model_id is not None and h.block_size is not None:
            chain = await prompt.chain(h.model_id, h.block_size)
        ops: list[Awaitable[tuple[bool, None]]] = []
        if request.session_id:
            ttl = cfg.affinity.session_ttl_s
            ops.append(
                self._store_call(
                    "set_session", self._store.set_session(request.session_id, replica_id, ttl)
                )
            )
        if chain:
            blocks = bounded_chain(chain, cfg.affinity.max_blocks_per_record)
            ops.append(
                self._store_call(
                    "record_prefix",
                    self._store.record_prefix(replica_id, blocks, cfg.affinity.prefix_ttl_s),
                )
            )
        await asyncio.gather(*ops)

    # -- Generate ------------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self.draining:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "router is draining")
        rec = self._open(request, context)
        self.inflight += 1
        self._metrics.inflight.inc()
        try:
            for attempt in range(1, self._config.max_attempts + 1):
                handle = await self._route_attempt(rec, context, attempt)
                try:
                    async with contextlib.aclosing(self._proxy(rec, handle, context)) as relay:
                        async for resp in relay:
                            yield resp
                    rec.outcome = "ok"
                    return
                except grpc.aio.AioRpcError as e:
                    if not self._retry(rec, handle, e, attempt):
                        rec.outcome = e.code().name
                        await abort(context, e.code(), e.details() or e.code().name)
                finally:
                    handle.inflight -= 1
        finally:
            self._close(rec)

    def _open(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> _Routed:
        """Starts the router span and the prompt's hashing (off the event loop)."""
        t0 = time.monotonic()
        metadata = list(context.invocation_metadata() or ())
        span = self._tracer.start_span(
            "route deja.v1.Inference/Generate",
            context=extract_context(metadata),
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": SERVICE_NAME,
                "rpc.method": "Generate",
                "deja.request_id": request.request_id,
                "deja.route.policy": self._config.policy,
            },
        )
        prompt = PromptChains(self._hasher, request, self._hasher.cache_salt(request, metadata))
        if self._config.policy != "round_robin":
            prompt.start()
        key = request.session_id or request.request_id or uuid.uuid4().hex
        return _Routed(request, key, span, forward_metadata(metadata, span), prompt, t0)

    async def _route_attempt(
        self, rec: _Routed, context: grpc.aio.ServicerContext, attempt: int
    ) -> ReplicaHandle:
        """Picks the replica for this attempt; aborts UNAVAILABLE when there is none."""
        try:
            rec.decision, handle = await self.route(rec.request, rec.key, rec.prompt, rec.exclude)
        except NoReplicaError:
            rec.outcome = "UNAVAILABLE"
            detail = "no healthy replica to route to"
            if rec.exclude:
                detail += f" (tried {', '.join(sorted(rec.exclude))})"
            await abort(context, grpc.StatusCode.UNAVAILABLE, detail)
        d = rec.decision
        rec.span.add_event(
            "routed", {"replica_id": d.replica_id, "reason": d.reason, "attempt": attempt}
        )
        return handle

    async def _proxy(
        self, rec: _Routed, handle: ReplicaHandle, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Relays the replica's stream; the final message gets the route, after the record."""
        d = rec.decision
        assert d is not None
        rec.got_first = False
        # The stream and its prompt's uncached tokens count as pending on this replica until the
        # first message (the cost policy reads them between load polls).
        call = handle.stub.Generate(
            rec.request, timeout=context.time_remaining(), metadata=rec.metadata
        )
        try:
            async for resp in call:
                if not rec.got_first:
                    rec.got_first = True
                    handle.end_pending(d.uncached_tokens)
                    self._metrics.ttft.observe(time.monotonic() - rec.t0)
                    log.debug(
                        "first token %s on %s after %.3fs (est %.3fs)",
                        rec.key, d.replica_id, time.monotonic() - rec.t0, d.est_ttft_s,
                    )  # fmt: skip
                if resp.HasField("final"):
                    resp.final.route.replica_id = d.replica_id
                    resp.final.route.reason = d.reason
                    await self.record(rec.request, d.replica_id, rec.prompt)
                yield resp
        finally:
            if not rec.got_first:
                handle.end_pending(d.uncached_tokens)
            call.cancel()

    def _retry(
        self, rec: _Routed, handle: ReplicaHandle, e: grpc.aio.AioRpcError, attempt: int
    ) -> bool:
        """Whether to try another replica (service/router/retry.py): nothing was relayed yet, the
        failure is the replica's, attempts are left and a healthy replica not tried yet is (else
        the caller gets this replica's error)."""
        code = e.code()
        reason = retry_reason(code, e.details(), e.trailing_metadata())
        if rec.got_first or reason is None or attempt >= self._config.max_attempts:
            return False
        assert rec.decision is not None
        if replica_is_down(reason):
            self._pool.mark_down(handle, f"Generate: {e.details()}")
        rec.exclude.add(rec.decision.replica_id)
        if not self._pool.healthy(rec.exclude):
            return False
        self._metrics.retries.labels(reason).inc()
        rec.span.add_event(
            "retry",
            {"replica_id": rec.decision.replica_id, "code": code.name, "reason": reason},
        )
        return True

    def _close(self, rec: _Routed) -> None:
        """Counts the call by replica, reason and outcome, and ends its span."""
        rec.prompt.cancel()
        self.inflight -= 1
        self._metrics.inflight.dec()
        d = rec.decision
        replica, reason = (d.replica_id, d.reason) if d is not None else ("none", "none")
        self._metrics.requests.labels(replica, reason, rec.outcome).inc()
        if d is not None:
            rec.span.set_attributes(
                {
                    "deja.route.replica_id": d.replica_id,
                    "deja.route.reason": d.reason,
                    "deja.route.prefix_blocks": d.prefix_blocks,
                    "deja.route.uncached_tokens": d.uncached_tokens,
                    "deja.route.est_ttft_s": d.est_ttft_s,
                    "deja.route.attempts": len(rec.exclude) + 1,
                }
            )
        if rec.outcome != "ok":
            rec.span.set_status(Status(StatusCode.ERROR, rec.outcome))
        rec.span.end()

    # -- unary calls ---------------------------------------------------------------------------

    async def _unary(self, context: grpc.aio.ServicerContext, method: str, request: Any) -> Any:
        """Forwards `request` to `method` of the least loaded healthy replica, the next one on
        UNAVAILABLE."""
        md = forward_metadata(list(context.invocation_metadata() or ()), None)
        exclude: set[str] = set()
        last: grpc.aio.AioRpcError | None = None
        for _ in range(self._config.max_attempts):
            healthy = self._pool.healthy(exclude)
            if not healthy:
                break
            h = min(healthy, key=lambda h: (h.candidate().load, h.replica_id or ""))
            try:
                return await _forward(h, method, request, context.time_remaining(), md)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    await abort(context, e.code(), e.details() or e.code().name)
                last = e
                assert h.replica_id is not None
                exclude.add(h.replica_id)
        detail = last.details() if last is not None else "no healthy replica"
        await abort(context, grpc.StatusCode.UNAVAILABLE, detail or "no healthy replica")

    async def _all(self, context: grpc.aio.ServicerContext, method: str, request: Any) -> list[Any]:
        """Forwards `request` to `method` of every healthy replica; the answers, failures left
        out (logged)."""
        md = forward_metadata(list(context.invocation_metadata() or ()), None)
        healthy = self._pool.healthy()
        timeout = context.time_remaining()
        results = await asyncio.gather(
            *(_forward(h, method, request, timeout, md) for h in healthy), return_exceptions=True
        )
        out: list[Any] = []
        for h, r in zip(healthy, results, strict=True):
            if isinstance(r, grpc.aio.AioRpcError):
                if r.code() == grpc.StatusCode.UNAUTHENTICATED:
                    await context.abort(r.code(), r.details() or "unauthenticated")
                log.debug("replica %s: %s", h.replica_id, r)
            elif isinstance(r, BaseException):
                raise r
            else:
                out.append(r)
        return out

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return await self._unary(context, "Tokenize", request)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return await self._unary(context, "GetModelInfo", request)

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.Load:
        loads = await self._all(context, "GetLoad", request)
        out = pb.Load(replica_id=self._config.router_id, draining=self.draining)
        for load in loads:
            out.running += load.running
            out.waiting += load.waiting
            out.queued_streams += load.queued_streams
        if loads:
            out.kv_usage = sum(x.kv_usage for x in loads) / len(loads)
            out.prefix_hit_rate = sum(x.prefix_hit_rate for x in loads) / len(loads)
        out.active_streams = self.inflight
        return out

    async def GetCacheStats(
        self, request: pb.GetCacheStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.CacheStats:
        stats = await self._all(context, "GetCacheStats", request)
        out = pb.CacheStats(replica_id=self._config.router_id)
        tiers: dict[str, pb.TierStats] = {}
        buffers: dict[str, pb.BufferStats] = {}
        for s in stats:
            out.free_device_blocks += s.free_device_blocks
            out.total_device_blocks += s.total_device_blocks
            out.prefix_queries += s.prefix_queries
            out.prefix_hits += s.prefix_hits
            _sum_by_name(tiers, s.tiers, pb.TierStats)
            _sum_by_name(buffers, s.buffers, pb.BufferStats)
        out.tiers.extend(tiers.values())
        out.buffers.extend(buffers.values())
        return out

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        results = await self._all(context, "Abort", request)
        aborted = {rid for r in results for rid in r.aborted}
        return pb.AbortResponse(aborted=[rid for rid in request.request_ids if rid in aborted])


def _describe(c: Candidate) -> str:
    """One candidate's load as the policy saw it (debug log)."""
    return (
        f"{c.replica_id}[load {c.load} q {c.queued_prefill_tokens} pend {c.pending_prefill_tokens}"
        f"/{c.pending_requests}"
        f" dec {c.decoding} rate {c.prefill_tokens_per_s:.0f} util {c.utilisation:.2f}]"
    )
