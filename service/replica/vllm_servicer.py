"""`vllm.grpc.engine.VllmEngine` on the replica, beside deja.v1.Inference on the same port: the
engine protocol the SMG gateway (PyPI `smg`) speaks, so every OpenAI client reaches deja through
it. Thin: each call goes through the deja.v1 servicer it wraps (same engine client, same streams,
admission control, auth, cache salt, spans and metrics); only the messages differ
(service/replica/vllm_convert.py).

    HealthCheck        healthy while the engine lives and the replica is not draining
    GetModelInfo       the tokenizer folder as tokenizer_path, max_model_len as the context limit
    GetServerInfo      uptime, open streams, block size, dtype
    GetTokenizer       the tokenizer files as a zip stream, sha256 on the last chunk (a GGUF
                       file's written out once)
    Generate           token ids in; streamed chunks of new ids, then one Complete per choice
    Abort              the caller's own requests (the tenant from its metadata)
    GetLoads           the engine's snapshot (running, waiting, KV usage, queued prefill tokens)
    SubscribeKvEvents  the replica's KV-event ring, resumable by sequence number
    Embed, FlushCache, StartProfile, StopProfile    UNIMPLEMENTED

The tenant (and so the cache salt) comes from the caller's `authorization` metadata exactly as on
deja.v1; nothing in a request body names it. Trace context in the metadata (`traceparent`)
parents the request's span. Bad input: INVALID_ARGUMENT with what to fix.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from service.replica import vllm_convert as vc
from service.replica.generate import GenerateRpc
from service.replica.servicer_base import Engine, ServicerBase

log = logging.getLogger(__name__)

VLLM_SERVICE_NAME = "vllm.grpc.engine.VllmEngine"


def _deja_version() -> str:
    try:
        return "deja " + version("deja")
    except PackageNotFoundError:
        return "deja"


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    """VllmEngine over the replica's deja.v1 servicer (`rpc`)."""

    def __init__(self, rpc: GenerateRpc, tokenizer_dir: Path | None) -> None:
        self._rpc = rpc
        self._tokenizer_dir = tokenizer_dir
        self._bundle: asyncio.Task[tuple[bytes, str]] | None = None
        self._started = time.time()
        self._last_receive = 0.0
        self._version = _deja_version()

    @property
    def _base(self) -> ServicerBase:
        return self._rpc

    async def HealthCheck(
        self, request: vpb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> vpb.HealthCheckResponse:
        await self._base._authenticate(context)
        rpc = self._rpc
        try:
            rpc._engine.check_health()
        except Exception as e:
            await rpc.engine_failed_now(e)
            return vpb.HealthCheckResponse(healthy=False, message=f"engine failed: {e}")
        if rpc.draining:
            return vpb.HealthCheckResponse(healthy=False, message="draining")
        return vpb.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(
        self, request: vpb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> vpb.GetModelInfoResponse:
        await self._rpc._check_request(request, context, allow_draining=True)
        info = self._rpc._engine.model_info
        tok = self._rpc._engine.tokenizer
        folder = str(self._tokenizer_dir or "")
        return vpb.GetModelInfoResponse(
            model_path=folder,
            is_generation=True,
            # NOTE: the gateway refuses (HTTP 400) prompts longer than max_context_length before
            # any Generate; a prompt needs room for one generated token.
            max_context_length=info.max_model_len,
            max_req_input_len=info.max_model_len - 1,
            vocab_size=info.vocab_size,
            served_model_name=info.model_id,
            tokenizer_path=folder,
            model_type=info.family,
            architectures=[info.architecture],
            eos_token_ids=list(info.eos_token_ids),
            pad_token_id=_token_id(getattr(tok, "pad_token_id", None)),
            bos_token_id=_token_id(getattr(tok, "bos_token_id", None)),
        )

    async def GetServerInfo(
        self, request: vpb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> vpb.GetServerInfoResponse:
        await self._rpc._check_request(request, context, allow_draining=True)
        info = self._rpc._engine.model_info
        return vpb.GetServerInfoResponse(
            active_requests=len(self._rpc.streams),
            is_paused=self._rpc.draining,
            last_receive_timestamp=self._last_receive,
            uptime_seconds=time.time() - self._started,
            server_type="deja-grpc",
            data_parallel_size=1,
            block_size=info.block_size,
            model_dtype=info.dtype,
        )

    async def GetLoads(
        self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> vpb.GetLoadsResponse:
        await self._rpc._check_request(request, context, allow_draining=True)
        info = self._rpc._engine.model_info
        load = vc.scheduler_load(
            self._rpc._engine.get_stats(), info.num_device_blocks, info.block_size
        )
        return vpb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=self._version,
            dp_rank_count=1,
            loads=[load],
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        await self._rpc._check_request(request, context, allow_draining=True)
        folder = self._tokenizer_dir
        if folder is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this replica does not know its tokenizer folder; give the gateway "
                "--tokenizer-path",
            )
        assert folder is not None
        if self._bundle is None:  # built once, off the event loop
            self._bundle = asyncio.ensure_future(asyncio.to_thread(vc.tokenizer_bundle, folder))
        try:
            data, sha256 = await asyncio.shield(self._bundle)
        except OSError as e:
            self._bundle = None
            await context.abort(grpc.StatusCode.INTERNAL, f"cannot read the tokenizer: {e}")
        for chunk in vc.tokenizer_chunks(data, sha256):
            yield chunk

    async def Generate(
        self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[vpb.GenerateResponse]:
        self._last_receive = time.time()
        try:
            dreq = vc.deja_request(request)
            defaults = dict(self._rpc._engine.model_info.sampling_defaults)
            params = vc.sampling_params(request.sampling_params, defaults)
        except ValueError as e:
            await self._rpc._check_request(request, context)  # auth first, as deja.v1 does
            await self._rpc._abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, str(e), "invalid_argument"
            )
        mapper = vc.ResponseMapper(stream=request.stream)
        responses = self._rpc.generate_stream(dreq, context, params)
        async with contextlib.aclosing(responses):
            async for resp in responses:
                for out in mapper.map(resp):
                    yield out

    async def Abort(
        self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> vpb.AbortResponse:
        tenant = await self._rpc._check_request(request, context, allow_draining=True)
        aborted = self._rpc.abort_own(tenant, request.request_ids)
        log.info("VllmEngine Abort of %s: aborted %s", list(request.request_ids), aborted)
        return vpb.AbortResponse()

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        await self._rpc._check_request(request, context)
        with_tokens = not self._rpc._auth.enabled
        batches = self._rpc.kv_events.subscribe(request.start_sequence_number)
        async with contextlib.aclosing(batches):  # type: ignore[type-var]
            async for batch in batches:
                yield vc.kv_event_batch(batch, with_tokens=with_tokens)


def tokenizer_dir(engine: Engine) -> Path | None:
    """The folder the engine's tokenizer was loaded from; for one read from elsewhere (a GGUF
    file) a private folder its files are written to once, removed at exit; None when neither."""
    tokenizer = engine.tokenizer
    path = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if path.is_dir() and any(p.name.startswith("tokenizer") for p in path.iterdir()):
        return path
    if not hasattr(tokenizer, "save_pretrained"):
        return None
    out = Path(tempfile.mkdtemp(prefix="deja-tokenizer-"))
    atexit.register(shutil.rmtree, out, True)
    tokenizer.save_pretrained(str(out))
    return out


def _token_id(value: object) -> int:
    return value if isinstance(value, int) else 0


def add_vllm_servicer(servicer: VllmEngineServicer, server: grpc.aio.Server) -> None:
    vpb_grpc.add_VllmEngineServicer_to_server(servicer, server)
