"""A stand-in deja.v1 replica for fast router tests: no engine, scripted answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from service.api.deja.v1 import inference_pb2 as pb
from service.api.deja.v1 import inference_pb2_grpc as pb_grpc

MODEL_ID = "fake-model"
BLOCK_SIZE = 4


@dataclass
class Seen:
    request: pb.GenerateRequest
    metadata: dict[str, str]
    time_remaining: float | None


@dataclass
class FakeReplica(pb_grpc.InferenceServicer):
    replica_id: str
    deltas: int = 3
    delay_s: float = 0.0
    """Pause before each delta."""
    fail_before_first: grpc.StatusCode | None = None
    """Abort each Generate with this status (after `delay_s`) before its first message."""
    fail_details: str = ""
    """The abort's details (default: "<replica_id> refuses")."""
    fail_trailer: tuple[tuple[str, str], ...] = ()
    """The abort's trailing metadata."""
    max_receive_bytes: int | None = None
    """gRPC's receive limit of the server (None: gRPC's default)."""
    running: int = 0
    waiting: int = 0
    seen: list[Seen] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    server: grpc.aio.Server | None = None
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        options = []
        if self.max_receive_bytes is not None:
            options.append(("grpc.max_receive_message_length", self.max_receive_bytes))
        self.server = grpc.aio.server(options=options)
        pb_grpc.add_InferenceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
            self.server = None

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        md = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        self.seen.append(Seen(request, md, context.time_remaining()))
        if self.fail_before_first is not None:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            details = self.fail_details or f"{self.replica_id} refuses"
            await context.abort(self.fail_before_first, details, self.fail_trailer)
        n_prompt = len(request.token_ids.ids)
        try:
            for i in range(self.deltas):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                resp = pb.GenerateResponse(request_id=request.request_id)
                resp.choices.add(index=0, text=f"t{i} ")
                if i == self.deltas - 1:
                    resp.final.replica_id = self.replica_id
                    resp.final.usage.prompt_tokens = n_prompt
                    resp.final.usage.completion_tokens = self.deltas
                yield resp
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return pb.TokenizeResponse(token_ids=[ord(c) for c in request.text])

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return pb.ModelInfo(model_id=MODEL_ID, block_size=BLOCK_SIZE, replica_id=self.replica_id)

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.Load:
        return pb.Load(
            replica_id=self.replica_id, running=self.running, waiting=self.waiting, kv_usage=0.1
        )

    async def GetCacheStats(
        self, request: pb.GetCacheStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.CacheStats:
        return pb.CacheStats(
            replica_id=self.replica_id,
            prefix_queries=10,
            prefix_hits=4,
            tiers=[pb.TierStats(name="device", num_blocks=8, used_blocks=2)],
        )

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        mine = [r for r in request.request_ids if r.startswith(self.replica_id)]
        return pb.AbortResponse(aborted=mine)
