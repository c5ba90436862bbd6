"""The asyncio face of the engine: `EngineClient` streams requests through an engine core whose
loop (engine/core/core_loop.py) runs elsewhere, in a thread (`AsyncEngine`, engine/frontend/
async_engine.py) or a process (`EngineCoreClient`, engine/frontend/core_client.py).

It lives in the API server's event loop. It tokenizes and validates requests itself
(`InputProcessor`), makes the text of the core's token deltas (`RequestText`, while the core runs
its next step), submits typed commands (engine/core/messages.py) and fans the core's messages out
to one asyncio.Queue per request, in the event loop's thread.

Failure model:
- the core fails (a step raised, a worker or the core process died): every open stream gets
  EngineDeadError, `errored` turns True, `check_health()` raises; `deja serve` then exits
  non-zero so an orchestrator restarts the replica;
- a reader more than `stream_buffer` deltas behind is aborted (its blocks freed) and its
  generator raises StreamOverflowError;
- leaving a `generate()` early (cancellation, deadline) sends an abort: the core frees the
  request's blocks before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from engine.core.messages import (
    AbortRequests,
    AddRequest,
    Call,
    CallResult,
    Command,
    CoreMessage,
    Failed,
    Outputs,
    Rejected,
)
from engine.errors import EngineDeadError, StreamOverflowError
from engine.frontend.base import read_outputs
from engine.frontend.input_processor import InputProcessor
from engine.frontend.output_text import RequestText
from engine.frontend.prompt import Prompt
from engine.kv.events import KVEventBatch, KVSnapshot
from engine.outputs import RequestOutput
from engine.sample.sampling_params import SamplingParams
from engine.stats import EngineStats, ModelInfo

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    prompt_token_ids: list[int]
    queue: asyncio.Queue[RequestOutput | BaseException]
    text: RequestText
    """Makes the text of the core's deltas, here in the API server's process."""
    closed: bool = False


class EngineClient:
    """Requests in, streamed deltas out, over a core that runs its own loop; subclasses start
    the core and carry the commands (`_submit`)."""

    _id_prefix = "req"

    def __init__(
        self, tokenizer: Any, model_info: ModelInfo, stats: EngineStats, inputs: InputProcessor,
        *, stream_buffer: int,
    ) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self._model_info = model_info
        self._stats = stats
        """The core's latest snapshot (its messages refresh it)."""
        self._inputs = inputs
        self.stream_buffer = stream_buffer
        self._loop: asyncio.AbstractEventLoop | None = None
        """The event loop that reads the core's messages (one per server; tests may run several
        in turn)."""
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._ids = itertools.count(1)
        self._dead: str | None = None
        self._kv_sink: Callable[[KVEventBatch], None] | None = None

    # -- facts ---------------------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    def get_stats(self) -> EngineStats:
        """The latest snapshot the core sent (never blocks)."""
        return self._stats

    def tokenize(
        self, text: Prompt | None = None, messages: list[dict[str, str]] | None = None
    ) -> list[int]:
        return self._inputs.tokenize(text, messages)

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def check_health(self) -> None:
        """Raises EngineDeadError when the core has failed."""
        if self.errored:
            raise EngineDeadError(self._dead)

    # -- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt | None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        messages: list[dict[str, str]] | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams deltas of one request; leaving early aborts it and frees its blocks.

        Raises ValueError (bad input, a request id in use) at the first iteration.
        """
        self.check_health()
        self._attach()
        rid = request_id or f"{self._id_prefix}-{next(self._ids)}"
        req = self._inputs.prepare(
            prompt, params, request_id=rid, messages=messages, cache_salt=cache_salt
        )
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        prompt_ids = req.prompt_token_ids
        stream = _Stream(
            prompt_ids, asyncio.Queue(), RequestText(self.tokenizer, prompt_ids, req.params)
        )
        self._streams[rid] = stream

        def leave(finished: bool) -> None:
            self._streams.pop(rid, None)
            if not finished and self._dead is None:
                self._abort([rid])

        outputs = read_outputs(
            stream.queue, start=lambda: self._submit(AddRequest(req)), leave=leave
        )
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> bool:
        """Aborts a request; the core frees its blocks before its next step."""
        if self._dead is None:
            self._abort([request_id])
        return request_id in self._streams

    def _abort(self, request_ids: list[str]) -> None:
        """Aborts never raise: with the core gone there is nothing left to abort."""
        with contextlib.suppress(EngineDeadError):
            self._submit(AbortRequests(request_ids))

    async def call(self, name: str, *args: Any) -> Any:
        """Runs a read-only core method (engine.core.messages.CALLS) in the core, between steps."""
        self.check_health()
        self._attach()
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._submit(Call(call_id, name, args))
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    async def cached_block_hashes(self, limit: int) -> list[bytes]:
        """Block hashes the core holds (device, CPU, disk): what a replica republishes."""
        return list(await self.call("cached_block_hashes", limit))

    async def kv_snapshot(self) -> KVSnapshot:
        """What every tier of the core holds now, with the index of the last KV-event batch the
        core sent before it (the batches after it follow the snapshot)."""
        snap: KVSnapshot = await self.call("kv_snapshot")
        return snap

    def set_kv_event_sink(self, sink: Callable[[KVEventBatch], None] | None) -> None:
        """Calls `sink(batch)` on the calling event loop for each KV-event batch the core sends,
        in order (None: drop them). One sink at a time; the last one set wins."""
        self._kv_sink = sink
        if sink is not None:
            self._attach()

    # -- the core's messages (the event loop's thread) -----------------------------------------
    def _submit(self, cmd: Command) -> None:
        raise NotImplementedError  # the transport's: a thread's queue or a process's pipe

    def _attach(self) -> None:
        """Reads the core's messages on the running loop (once per loop)."""
        self._loop = asyncio.get_running_loop()

    def _dispatch(self, msg: CoreMessage) -> None:
        if isinstance(msg, Outputs):
            for out in msg.outputs:
                self._deliver(out)
            if msg.stats is not None:
                self._stats = msg.stats
            if msg.kv_events is not None and self._kv_sink is not None:
                self._kv_sink(msg.kv_events)
        elif isinstance(msg, Rejected):
            self._push(msg.request_id, ValueError(msg.message))
        elif isinstance(msg, CallResult):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                if msg.ok:
                    fut.set_result(msg.value)
                else:
                    fut.set_exception(RuntimeError(msg.value))
        elif isinstance(msg, Failed):
            self._mark_dead(msg.message)

    def _deliver(self, out: RequestOutput) -> None:
        rid = out.request_id
        stream = self._streams.get(rid)
        if stream is None:
            if not out.finished:  # nobody listens (the caller left): stop the request
                self._abort([rid])
            return
        if stream.closed:
            return
        out.prompt_token_ids = stream.prompt_token_ids
        stream.text.apply(out)
        if stream.queue.qsize() >= self.stream_buffer and not out.finished:
            stream.closed = True
            self._abort([rid])
            stream.queue.put_nowait(
                StreamOverflowError(
                    f"request {rid} was aborted: its reader fell {stream.queue.qsize()} "
                    "messages behind"
                )
            )
            return
        stream.closed = out.finished
        stream.queue.put_nowait(out)

    def _push(self, rid: str, err: BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is not None and not stream.closed:
            stream.closed = True
            stream.queue.put_nowait(err)

    def _mark_dead(self, message: str, *, quiet: bool = False) -> None:
        if self._dead is not None:
            return
        self._dead = message
        if not quiet:
            log.error("engine core is dead: %s", message)
        err = EngineDeadError(message)
        for rid in list(self._streams):
            self._push(rid, err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(message))
