"""The asyncio client of the deja.v1 API (grpc.aio); see clients/client.py for the sync one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import grpc

from clients.base import ClientBase
from clients.request import build_request, tokenize_request
from clients.result import GenerateResult, collector
from service.api.deja.v1 import inference_pb2 as pb


class AsyncDejaClient(ClientBase):
    """asyncio client (grpc.aio); create it inside the event loop that uses it."""

    _channel: grpc.aio.Channel

    def _open_channel(self, target: str, creds: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
        if creds is not None:
            return grpc.aio.secure_channel(target, creds)
        return grpc.aio.insecure_channel(target)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncDejaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Streams the response messages (see build_request for the arguments)."""
        return self.stream(build_request(prompt, **kwargs), timeout=timeout)

    async def stream(
        self, req: pb.GenerateRequest, *, timeout: float | None = None
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        with self._generate_call(req, timeout) as gen:
            while True:
                call = self._attempt(req, gen)
                try:
                    msg = await call.read()
                    break
                except grpc.aio.AioRpcError as e:
                    wait = self._retry_wait(e, gen)
                    if wait is None:
                        raise
                    await asyncio.sleep(wait)
            while msg is not grpc.aio.EOF:
                gen.add(msg)
                yield msg
                msg = await call.read()

    async def complete(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> GenerateResult:
        result, add = collector(kwargs)
        async for msg in self.generate(prompt, timeout=timeout, **kwargs):
            add(msg)
        return result

    async def tokenize(
        self, text: str | None = None, *, messages: Sequence[dict[str, str]] | None = None
    ) -> list[int]:
        resp = await self._unary(self.stub.Tokenize, tokenize_request(text, messages))
        return list(resp.token_ids)

    async def model_info(self) -> pb.ModelInfo:
        return await self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest())

    async def load(self) -> pb.Load:
        return await self._unary(self.stub.GetLoad, pb.GetLoadRequest())

    async def cache_stats(self) -> pb.CacheStats:
        return await self._unary(self.stub.GetCacheStats, pb.GetCacheStatsRequest())

    async def abort(self, *request_ids: str) -> list[str]:
        resp = await self._unary(self.stub.Abort, pb.AbortRequest(request_ids=request_ids))
        return list(resp.aborted)

    async def kv_events(
        self, start_sequence_number: int = 0, *, timeout: float | None = None
    ) -> AsyncGenerator[pb.KvEventBatch, None]:
        """The replica's KV-event batches from `start_sequence_number` on (0: a snapshot first),
        until the server ends the stream or `timeout` passes; leaving the loop cancels the call.
        To resume after a break, pass the last sequence_number received + 1."""
        call = self.stub.SubscribeKvEvents(
            pb.SubscribeKvEventsRequest(start_sequence_number=start_sequence_number),
            timeout=timeout,
            metadata=self._metadata(),
        )
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()
