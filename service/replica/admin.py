"""The replica's RPCs besides Generate: Tokenize, GetModelInfo, GetLoad (answered while
draining, for the router), GetCacheStats, Abort (the caller's own requests only) and
SubscribeKvEvents, which streams the engine's KV events from the replica's ring
(service/replica/kv_events.py) under the same auth rules; with auth on, stores carry no token ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from service.api.deja.v1 import inference_pb2 as pb
from service.replica import convert
from service.replica.servicer_base import BadMessage, ServicerBase


class AdminRpcs(ServicerBase):
    """The unary calls and the KV-event stream."""

    async def Tokenize(
        self, request: pb.TokenizeRequest | BadMessage, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        await self._check_request(request, context)
        assert isinstance(request, pb.TokenizeRequest)
        try:
            inp = convert.engine_input(request)
            ids = self._engine.tokenize(
                text=inp.prompt if isinstance(inp.prompt, str) else None, messages=inp.messages
            )
        except ValueError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid_argument")
        return pb.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest | BadMessage, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        await self._check_request(request, context)
        return convert.model_info_message(self._engine.model_info, self.replica_id)

    async def GetLoad(
        self, request: pb.GetLoadRequest | BadMessage, context: grpc.aio.ServicerContext
    ) -> pb.Load:
        await self._check_request(request, context, allow_draining=True)
        return convert.load_message(
            self._engine.get_stats(),
            self.replica_id,
            active_streams=len(self.streams),
            queued_streams=self.num_queued,
            draining=self.draining,
        )

    async def GetCacheStats(
        self, request: pb.GetCacheStatsRequest | BadMessage, context: grpc.aio.ServicerContext
    ) -> pb.CacheStats:
        await self._check_request(request, context)
        return convert.cache_stats_message(
            self._engine.get_stats(), self._engine.model_info, self.replica_id
        )

    async def Abort(
        self, request: pb.AbortRequest | BadMessage, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        tenant = await self._check_request(request, context)
        assert isinstance(request, pb.AbortRequest)
        return pb.AbortResponse(aborted=self.abort_own(tenant, request.request_ids))

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest | BadMessage, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvEventBatch]:
        await self._check_request(request, context)
        assert isinstance(request, pb.SubscribeKvEventsRequest)
        with_tokens = not self._auth.enabled
        batches = self.kv_events.subscribe(request.start_sequence_number)
        async with contextlib.aclosing(batches):  # type: ignore[type-var]
            async for batch in batches:
                for msg in convert.kv_batch_messages(batch, with_tokens=with_tokens):
                    yield msg
