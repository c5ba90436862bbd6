"""The replica's Generate RPC, in named steps: `_admit` (entry checks, engine health, admission
control), `_open` (engine request, stream, span), the record's `responses` (engine deltas to
response messages, service/replica/streams.py), `_close` (outcome, usage, span, metrics) and
`_fail` (the error status).

A cancelled call or a passed deadline aborts the engine request (and frees its blocks) within one
engine step: leaving the engine's output generator aborts it, and a done-callback on the call
aborts it too in case the handler is cancelled while gRPC is writing.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from engine.outputs import RequestOutput
from engine.sample.sampling_params import SamplingParams
from service.api.deja.v1 import inference_pb2 as pb
from service.common.auth import derive_cache_salt
from service.common.tracing import end_request_span, extract_context, start_request_span
from service.replica import convert
from service.replica.servicer_base import BadMessage, ServicerBase
from service.replica.streams import Stream, StreamRecord


class GenerateRpc(ServicerBase):
    """Generate: one engine request streamed back as GenerateResponse messages."""

    async def Generate(
        self, request: pb.GenerateRequest | BadMessage, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        async with contextlib.aclosing(self.generate_stream(request, context)) as stream:
            async for resp in stream:
                yield resp

    async def generate_stream(
        self,
        request: pb.GenerateRequest | BadMessage,
        context: grpc.aio.ServicerContext,
        params: SamplingParams | None = None,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Generate's messages; `params` (what another front door mapped itself, e.g. the
        VllmEngine servicer) replaces the request's `sampling` when given."""
        tenant = await self._admit(request, context)
        assert isinstance(request, pb.GenerateRequest)
        rec = await self._open(request, context, tenant, params)
        relay = rec.responses(self._metrics.itl, self.replica_id, self.on_finished)
        try:
            try:
                async with contextlib.aclosing(relay):
                    async for resp in relay:
                        yield resp
                        rec.sent += 1
            except asyncio.CancelledError:
                if context.time_remaining() is not None and context.time_remaining() <= 0:
                    rec.outcome = "deadline_exceeded"
                raise
            except Exception as e:
                rec.failed(e)
            finally:
                self._close(rec)
            if rec.error is not None:
                await self._fail(context, rec.outcome, rec.error, rec.trailer)
        finally:
            # NOTE: only now, with the error status set: a drain waits for `streams` to empty
            # before it stops the server, and a stopping server cancels the calls still open.
            self.streams.pop(rec.stream.engine_id, None)

    def _on_call_done(self, stream: Stream) -> None:
        if not stream.done:
            stream.done = True
            self._engine.abort(stream.engine_id)

    async def _admit(
        self, request: pb.GenerateRequest | BadMessage, context: grpc.aio.ServicerContext
    ) -> str | None:
        """Entry checks, engine health and admission control; returns the tenant."""
        tenant = await self._check_request(request, context)
        try:
            self._engine.check_health()
        except Exception as e:
            await self.engine_failed_now(e)
            await self._abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"the engine of replica {self.replica_id} has failed ({e}); retry on another "
                "replica",
                "rejected_engine_dead",
            )
        if self.num_queued >= self._config.max_queued_requests:
            await self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.num_queued} requests are already waiting on replica {self.replica_id} "
                f"(limit {self._config.max_queued_requests}); retry later or on another replica",
                "rejected_queue_full",
            )
        return tenant

    async def _open(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext,
        tenant: str | None,
        params: SamplingParams | None = None,
    ) -> StreamRecord:
        """Maps the request to engine types, registers the stream and starts its span and its
        engine request (which runs once the record's outputs are read)."""
        try:
            inp = convert.engine_input(request)
            if params is None:
                defaults = dict(self._engine.model_info.sampling_defaults)
                params = convert.sampling_params(request, defaults)
        except ValueError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid_argument")
        client_id = request.request_id or uuid.uuid4().hex
        engine_id = client_id if tenant is None else f"{tenant}/{client_id}"
        if engine_id in self.streams:
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request id {client_id!r} is already running; pick a unique id or leave it empty",
                "invalid_argument",
            )
        salt = derive_cache_salt(tenant, request.cache_salt, self._config.allow_client_cache_salt)
        span = start_request_span(
            self._tracer,
            parent=extract_context(context.invocation_metadata()),
            operation=inp.operation,
            model=self._model,
            request_id=client_id,
            params=params,
            replica_id=self.replica_id,
            tenant=tenant,
        )
        stream = Stream(engine_id, client_id, tenant)
        self.streams[engine_id] = stream
        context.add_done_callback(lambda _ctx: self._on_call_done(stream))
        self._metrics.active_streams.inc()
        outputs = self._engine.generate(
            inp.prompt, params, request_id=engine_id, messages=inp.messages, cache_salt=salt
        )
        return StreamRecord(request, stream, salt, span, outputs)

    def _close(self, rec: StreamRecord) -> None:
        """Records the stream's outcome, usage and span (it leaves `streams` once its status is
        set)."""
        rec.stream.done = True
        rec.stream.queued = False  # (no longer waiting, while its error status is set)
        self._metrics.active_streams.dec()
        if rec.error is None:  # failures are counted by _fail with their status
            self._metrics.requests.labels(rec.outcome).inc()
        self._record(rec.last, rec.tally)
        last = rec.last
        end_request_span(
            rec.span,
            last if last is not None and last.finished else None,
            completion_tokens=rec.tally.completion_tokens,
            finish_reasons=rec.finish_reasons,
            error=rec.error
            or (rec.outcome if rec.outcome in ("cancelled", "deadline_exceeded") else None),
        )

    async def _fail(
        self,
        context: grpc.aio.ServicerContext,
        outcome: str,
        error: str,
        trailer: tuple[tuple[str, str], ...] = (),
    ) -> None:
        if outcome == "invalid_argument":
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, error, outcome)
        if outcome == "stream_overflow":
            msg = f"the client read the stream too slowly; request aborted ({error})"
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, msg, outcome)
        try:
            self._engine.check_health()
        except Exception as e:
            await self.engine_failed_now(e)
        if outcome == "engine_dead":  # the replica cannot serve; the caller may go elsewhere
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, error, outcome, trailer)
        await self._abort(context, grpc.StatusCode.INTERNAL, error, "internal", trailer)

    def _record(self, last: RequestOutput | None, tally: convert.StreamTally) -> None:
        m = self._metrics
        m.generation_tokens.inc(tally.completion_tokens)
        if last is None or not last.finished:
            return
        m.prompt_tokens.inc(len(last.prompt_token_ids))
        for tier in ("device", "cpu", "disk", "remote"):
            m.cached_prompt_tokens.labels(tier).inc(getattr(last.cached_tokens, tier))
        t = last.metrics
        if t is not None:
            for hist, value in ((m.ttft, t.ttft), (m.queue_time, t.queue_time), (m.e2e, t.e2e)):
                if value is not None:
                    hist.observe(value)
