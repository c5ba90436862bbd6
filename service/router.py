"""The router's servicer: the replicas' public deja.v1.Inference API, in front of them (the
process around it, with health, reflection and metrics, is service/router_server.py).

Generate: pick a replica (service/router_policy.py over the healthy replicas of
service/router_pool.py, with the session and prefix records of the affinity store), proxy the
stream with the caller's deadline and metadata (bearer token; the W3C trace context becomes the
router span's), and retry on the next replica when one answers UNAVAILABLE (or
RESOURCE_EXHAUSTED: its queue is full) before the first message. The final message carries
`route {replica_id, reason}`; before it is relayed the router records `session -> replica` and
the prompt's block hashes, so the next turn finds them. Cancelling the call cancels the upstream
call. The store is an optimisation: when it fails, routing falls back to rendezvous hashing
(reason "fallback", counted in deja_router_fallback_total) and no request fails because of it.

Tokenize and GetModelInfo go to the least loaded healthy replica; GetLoad and GetCacheStats add
up the healthy replicas; Abort goes to every healthy replica.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode

from service.affinity.base import AffinityStore, AffinityStoreError
from service.affinity.prefix import bounded_chain
from service.proto.deja.v1 import inference_pb2 as pb
from service.proto.deja.v1 import inference_pb2_grpc as pb_grpc
from service.router_config import RouterConfig
from service.router_metrics import RouterMetrics
from service.router_policy import NoReplicaError, RouteDecision, RouteInputs, decide
from service.router_pool import ReplicaHandle, ReplicaPool
from service.router_prompt import PromptChains, PromptHasher
from service.tracing import extract_context, get_tracer

log = logging.getLogger(__name__)

SERVICE_NAME = "deja.v1.Inference"
_RETRY_BEFORE_FIRST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
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
        from service.tracing import inject_context

        inject_context(span, out)
    else:  # tracing off here: pass the caller's context through unchanged
        out += [(k, v) for k, v in metadata if k.lower() in ("traceparent", "tracestate")]
    return out


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
        healthy = self._pool.healthy(exclude)
        if not healthy:
            raise NoReplicaError("no healthy replica")
        store_ok, session_replica, prefix, prompt_tokens = True, None, None, 0
        if cfg.policy != "round_robin":
            if cfg.policy in ("affinity", "cost") and request.session_id:
                store_ok, session_replica = await self._store_call(
                    "get_session", self._store.get_session(request.session_id)
                )
            own = self._pool.by_id(session_replica) if session_replica else None
            sticky = own is not None and own.healthy and not cfg.guard.overloaded(own.candidate())
            if cfg.policy == "cost":
                sticky = False  # the session counts only through what its replica holds
                prompt_tokens = await prompt.num_tokens()
            if store_ok and not sticky:
                prefix = {}
                groups: dict[tuple[str, int], list[str]] = {}
                for h in healthy:
                    if h.model_id is not None and h.block_size is not None and h.replica_id:
                        groups.setdefault((h.model_id, h.block_size), []).append(h.replica_id)
                for (model_id, block_size), ids in groups.items():
                    chain = await prompt.chain(model_id, block_size)
                    if not chain:
                        continue
                    ok, held = await self._store_call(
                        "longest_prefix", self._store.longest_prefix(chain)
                    )
                    store_ok &= ok
                    prefix.update({rid: n for rid, n in (held or {}).items() if rid in ids})
        # NOTE: read the candidates' loads after the awaits and count the stream before the next
        # await, so concurrent arrivals see each other's choices.
        healthy = self._pool.healthy(exclude)
        if not healthy:
            raise NoReplicaError("no healthy replica")
        inputs = RouteInputs(key, session_replica, prefix, store_ok, prompt_tokens)
        decision = decide(
            cfg.policy,
            [h.candidate() for h in healthy],
            inputs,
            cfg.guard,
            next(self._rr),
            cfg.cost,
        )
        if decision.reason == "fallback":
            self._metrics.fallback.inc()
        handle = self._pool.by_id(decision.replica_id)
        assert handle is not None
        handle.inflight += 1
        handle.pending_prefill_tokens += decision.uncached_tokens
        return decision, handle

    async def _record(
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
            await _abort(context, grpc.StatusCode.UNAVAILABLE, "router is draining")
        t0 = time.monotonic()
        metadata = list(context.invocation_metadata() or ())
        key = request.session_id or request.request_id or uuid.uuid4().hex
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
        out_md = forward_metadata(metadata, span)
        prompt = PromptChains(self._hasher, request, self._hasher.cache_salt(request, metadata))
        if self._config.policy != "round_robin":
            prompt.start()
        exclude: set[str] = set()
        outcome = "CANCELLED"
        decision: RouteDecision | None = None
        self.inflight += 1
        self._metrics.inflight.inc()
        try:
            for attempt in range(1, self._config.max_attempts + 1):
                try:
                    decision, handle = await self.route(request, key, prompt, exclude)
                except NoReplicaError:
                    outcome = "UNAVAILABLE"
                    detail = "no healthy replica to route to"
                    if exclude:
                        detail += f" (tried {', '.join(sorted(exclude))})"
                    await _abort(context, grpc.StatusCode.UNAVAILABLE, detail)
                span.add_event(
                    "routed",
                    {
                        "replica_id": decision.replica_id,
                        "reason": decision.reason,
                        "attempt": attempt,
                    },
                )
                got_first = False
                pending = decision.uncached_tokens
                remaining = context.time_remaining()
                call = handle.stub.Generate(request, timeout=remaining, metadata=out_md)
                try:
                    async for resp in call:
                        if not got_first:
                            got_first = True
                            handle.pending_prefill_tokens -= pending
                            pending = 0
                            self._metrics.ttft.observe(time.monotonic() - t0)
                        if resp.HasField("final"):
                            resp.final.route.replica_id = decision.replica_id
                            resp.final.route.reason = decision.reason
                            await self._record(request, decision.replica_id, prompt)
                        yield resp
                    outcome = "ok"
                    return
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                    retry = not got_first and code in _RETRY_BEFORE_FIRST
                    if retry and attempt < self._config.max_attempts:
                        if code == grpc.StatusCode.UNAVAILABLE:
                            self._pool.mark_down(handle, f"Generate: {e.details()}")
                        exclude.add(decision.replica_id)
                        self._metrics.retries.inc()
                        span.add_event(
                            "retry", {"replica_id": decision.replica_id, "code": code.name}
                        )
                        continue
                    outcome = code.name
                    await _abort(context, code, e.details() or code.name)
                finally:
                    handle.inflight -= 1
                    handle.pending_prefill_tokens -= pending
                    call.cancel()
        finally:
            prompt.cancel()
            self.inflight -= 1
            self._metrics.inflight.dec()
            reason = decision.reason if decision is not None else "none"
            replica = decision.replica_id if decision is not None else "none"
            self._metrics.requests.labels(replica, reason, outcome).inc()
            if decision is not None:
                span.set_attributes(
                    {
                        "deja.route.replica_id": decision.replica_id,
                        "deja.route.reason": decision.reason,
                        "deja.route.prefix_blocks": decision.prefix_blocks,
                        "deja.route.uncached_tokens": decision.uncached_tokens,
                        "deja.route.est_ttft_s": decision.est_ttft_s,
                        "deja.route.attempts": len(exclude) + 1,
                    }
                )
            if outcome != "ok":
                span.set_status(Status(StatusCode.ERROR, outcome))
            span.end()

    # -- unary calls ---------------------------------------------------------------------------

    async def _unary(
        self,
        context: grpc.aio.ServicerContext,
        call: Callable[[ReplicaHandle, float | None, list[tuple[str, Any]]], Awaitable[T]],
    ) -> T:
        """Runs `call` on the least loaded healthy replica, the next one on UNAVAILABLE."""
        md = forward_metadata(list(context.invocation_metadata() or ()), None)
        exclude: set[str] = set()
        last: grpc.aio.AioRpcError | None = None
        for _ in range(self._config.max_attempts):
            healthy = self._pool.healthy(exclude)
            if not healthy:
                break
            h = min(healthy, key=lambda h: (h.candidate().load, h.replica_id or ""))
            try:
                return await call(h, context.time_remaining(), md)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    await _abort(context, e.code(), e.details() or e.code().name)
                last = e
                assert h.replica_id is not None
                exclude.add(h.replica_id)
        detail = last.details() if last is not None else "no healthy replica"
        await _abort(context, grpc.StatusCode.UNAVAILABLE, detail or "no healthy replica")

    async def _all(
        self,
        context: grpc.aio.ServicerContext,
        call: Callable[[ReplicaHandle, float | None, list[tuple[str, Any]]], Awaitable[T]],
    ) -> list[T]:
        """Runs `call` on every healthy replica; failures are left out (logged)."""
        md = forward_metadata(list(context.invocation_metadata() or ()), None)
        healthy = self._pool.healthy()
        timeout = context.time_remaining()
        results = await asyncio.gather(
            *(call(h, timeout, md) for h in healthy), return_exceptions=True
        )
        out: list[T] = []
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
        return await self._unary(
            context, lambda h, t, md: h.stub.Tokenize(request, timeout=t, metadata=md)
        )

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return await self._unary(
            context, lambda h, t, md: h.stub.GetModelInfo(request, timeout=t, metadata=md)
        )

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.Load:
        loads = await self._all(
            context, lambda h, t, md: h.stub.GetLoad(request, timeout=t, metadata=md)
        )
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
        stats = await self._all(
            context, lambda h, t, md: h.stub.GetCacheStats(request, timeout=t, metadata=md)
        )
        out = pb.CacheStats(replica_id=self._config.router_id)
        tiers: dict[str, pb.TierStats] = {}
        for s in stats:
            out.free_device_blocks += s.free_device_blocks
            out.total_device_blocks += s.total_device_blocks
            out.prefix_queries += s.prefix_queries
            out.prefix_hits += s.prefix_hits
            for t in s.tiers:
                acc = tiers.setdefault(t.name, pb.TierStats(name=t.name))
                for f in pb.TierStats.DESCRIPTOR.fields:
                    if f.name != "name":
                        setattr(acc, f.name, getattr(acc, f.name) + getattr(t, f.name))
        out.tiers.extend(tiers.values())
        return out

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        results = await self._all(
            context, lambda h, t, md: h.stub.Abort(request, timeout=t, metadata=md)
        )
        aborted = {rid for r in results for rid in r.aborted}
        return pb.AbortResponse(aborted=[rid for rid in request.request_ids if rid in aborted])


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, detail: str) -> NoReturn:
    await context.abort(code, detail)
    raise AssertionError("unreachable")
