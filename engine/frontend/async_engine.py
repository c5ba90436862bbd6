"""The asyncio face of the engine: a background thread runs the step loop; callers stream deltas.

Threading: only the step thread touches the LLMEngine's state. Callers validate and tokenize in
their own thread (`prepare_request` is pure), then hand requests and aborts to the step thread
through a command queue. Deltas travel back through one asyncio.Queue per request, fed with
`loop.call_soon_threadsafe`. A stream whose reader falls `stream_buffer` deltas behind is
aborted (its blocks are freed) and its generator raises StreamOverflowError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.core.sequence import Request
from engine.errors import EngineDeadError, StreamOverflowError
from engine.frontend.base import EngineFrontend, read_outputs
from engine.frontend.llm_engine import LLMEngine
from engine.kv.events import KVEventBatch, KVSnapshot
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    pending: int = 0
    """Deltas sent by the step thread and not yet read (step thread increments, reader decrements)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def took(self) -> None:
        """The reader took one item off the queue."""
        with self.lock:
            self.pending -= 1


class AsyncEngine(EngineFrontend):
    def __init__(self, engine: LLMEngine, *, stream_buffer: int = 1024) -> None:
        self.engine = engine
        self.stream_buffer = stream_buffer
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._stats = engine.get_stats()
        self._model_info = engine.model_info
        self._inputs = engine.inputs
        self._ids = 0
        self._flush_timeout_s: float | None = None
        self._kv_sink: tuple[asyncio.AbstractEventLoop, Callable[[KVEventBatch], None]] | None = (
            None
        )
        """Where the step thread sends KV-event batches: (the caller's loop, its callback)."""

    @classmethod
    def from_config(cls, config: EngineConfig, *, stream_buffer: int = 1024) -> AsyncEngine:
        """Loads the model (blocking) and builds the engine; call `start()` before generating."""
        return cls(LLMEngine(config), stream_buffer=stream_buffer)

    # -- facts ---------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine's step loop failed: {self._dead!r}")

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="deja-engine", daemon=True)
            self._thread.start()

    def shutdown(self, flush_timeout_s: float | None = None) -> None:
        """Aborts everything in flight, flushes the disk tier's queued writes (at most
        `flush_timeout_s`; None: all of them) and stops the step thread."""
        self._flush_timeout_s = flush_timeout_s
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30 + (flush_timeout_s or 0.0))
            self._thread = None

    # -- requests ------------------------------------------------------------------------------
    def _open(
        self, request_id: str | None, inputs: dict[str, Any]
    ) -> AsyncGenerator[RequestOutput, None]:
        req = self.engine.prepare_request(request_id=request_id or self._next_id(), **inputs)
        rid = req.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = stream

        def leave(finished: bool) -> None:
            with self._streams_lock:
                self._streams.pop(rid, None)
            if not finished:
                self._send(("abort", rid))

        return read_outputs(
            stream.queue, start=lambda: self._send(("add", req)), leave=leave, on_read=stream.took
        )

    def abort(self, request_id: str) -> bool:
        """Aborts a request (any thread); its blocks are freed before the next step."""
        with self._streams_lock:
            known = request_id in self._streams
        self._send(("abort", request_id))
        return known

    async def cached_block_hashes(self, limit: int) -> list[bytes]:
        """The block hashes the engine holds (LLMEngine.cached_block_hashes), asked of the step
        thread through the command queue."""
        self.check_health()
        fut: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
        self._send(("hashes", (limit, fut)))
        return await fut

    async def kv_snapshot(self) -> KVSnapshot:
        """LLMEngine.kv_snapshot, asked of the step thread between steps."""
        self.check_health()
        fut: asyncio.Future[KVSnapshot] = asyncio.get_running_loop().create_future()
        self._send(("snapshot", fut))
        return await fut

    def set_kv_event_sink(self, sink: Callable[[KVEventBatch], None] | None) -> None:
        """Calls `sink(batch)` on the calling event loop for each step's KV-event batch, in
        order (None: drop them)."""
        self._kv_sink = None if sink is None else (asyncio.get_running_loop(), sink)

    def _next_id(self) -> str:
        with self._streams_lock:
            self._ids += 1
            return f"areq-{self._ids}"

    def _send(self, cmd: tuple[str, Any]) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # -- the step thread -----------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not eng.has_unfinished_requests():
                    eng.expire_pins()  # an idle engine releases expired pins too
                    eng.trim_host_memory()
                    self._stats = eng.get_stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                started = time.monotonic()
                outs = eng.step()
                eng.step_rates.count_busy(time.monotonic() - started)
                self._stats = eng.get_stats()
                for out in outs:
                    self._deliver(out)
                self._ship_kv_events()
        except BaseException as e:
            log.exception("engine step loop failed")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine failed: {e!r}"))
            return
        for rid in list(eng.requests):
            eng.abort(rid)
        while eng.has_unfinished_requests():
            for out in eng.step():
                self._deliver(out)
        eng.close(self._flush_timeout_s)
        self._stats = eng.get_stats()

    def _drain_commands(self) -> None:
        eng = self.engine
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                req: Request = arg
                with self._streams_lock:
                    live = req.request_id in self._streams
                if not live:  # the caller left before the request reached the engine
                    continue
                try:
                    eng.enqueue(req)
                except ValueError as e:
                    self._push(req.request_id, e)
            elif kind == "snapshot":
                snap = eng.kv_snapshot()
                with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                    arg.get_loop().call_soon_threadsafe(_resolve, arg, snap)
            elif kind == "hashes":
                limit, fut = arg
                hashes = eng.cached_block_hashes(limit)
                with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                    fut.get_loop().call_soon_threadsafe(_resolve, fut, hashes)
            elif kind == "abort" and eng.abort(arg):
                # Deliver the final "abort" delta now, so blocks are free before any step.
                for out in eng.collect_outputs():
                    self._deliver(out)

    def _ship_kv_events(self) -> None:
        batch = self.engine.take_kv_events()
        sink = self._kv_sink
        if batch is not None and sink is not None:
            with contextlib.suppress(RuntimeError):  # the sink's loop is closed
                sink[0].call_soon_threadsafe(sink[1], batch)

    def _deliver(self, out: RequestOutput) -> None:
        with self._streams_lock:
            stream = self._streams.get(out.request_id)
        if stream is None:
            if not out.finished:
                self.engine.abort(out.request_id)
            return
        with stream.lock:
            if stream.closed:
                return
            if stream.pending >= self.stream_buffer and not out.finished:
                stream.closed = True
                self.engine.abort(out.request_id)
                err = StreamOverflowError(
                    f"request {out.request_id} was aborted: its reader fell {stream.pending} "
                    "messages behind"
                )
                stream.pending += 1
                _put(stream, err)
                return
            stream.pending += 1
            if out.finished:
                stream.closed = True
        _put(stream, out)

    def _push(self, rid: str, item: BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(rid)
        if stream is not None:
            with stream.lock:
                stream.pending += 1
                stream.closed = True
            _put(stream, item)

    def _fail_all(self, err: BaseException) -> None:
        with self._streams_lock:
            rids = list(self._streams)
        for rid in rids:
            self._push(rid, err)


def _resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
    # RuntimeError: the reader's event loop is closed; nobody is listening.
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
