"""`EngineCoreClient`: the AsyncEngine interface over an engine core in its own process.

The client lives in the API server's process and event loop. It tokenizes and validates requests
itself (`InputProcessor`), makes the text of the core's token deltas (`RequestText`, while the core
runs its next step), writes requests to the core (engine/core/core_process.py) through a pipe, and fans the
core's per-step output batches out to one asyncio.Queue per request: the outputs pipe is read by
the event loop itself (`add_reader`), so no thread sits between the core and the streams.

Failure model:
- the core process dies (killed, crashed, failed a step): every open stream gets
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
import multiprocessing as mp
import os
import pickle
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.core.core_process import PackedOutput, run_engine_core, unpack_output, widen_pipe
from engine.errors import EngineDeadError, StreamOverflowError
from engine.frontend.base import EngineFrontend, read_outputs
from engine.frontend.input_processor import InputProcessor
from engine.frontend.output_text import RequestText
from engine.kv.events import KVEventBatch, KVSnapshot
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    prompt_token_ids: list[int]
    queue: asyncio.Queue[RequestOutput | BaseException]
    text: RequestText
    """Makes the text of the core's deltas, here in the API server's process."""
    closed: bool = False


class EngineCoreClient(EngineFrontend):
    """Spawns the engine core, then serves `generate` / `abort` / stats like AsyncEngine."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        stream_buffer: int = 1024,
        start_timeout_s: float = 1800.0,
        log_level: int = logging.INFO,
    ) -> None:
        from engine.worker.model_loader import load_tokenizer

        self.config = config
        self.stream_buffer = stream_buffer
        mpctx = mp.get_context("spawn")
        core_in, self._in = mpctx.Pipe(duplex=False)
        self._out, core_out = mpctx.Pipe(duplex=False)
        widen_pipe(self._in)
        self._loop: asyncio.AbstractEventLoop | None = None
        """The event loop reading the outputs pipe (one per server; tests may run several in turn)."""
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._ids = itertools.count(1)
        self._dead: str | None = None
        self._kv_sink: Callable[[KVEventBatch], None] | None = None
        parent_conn, child_conn = mpctx.Pipe(duplex=False)
        self._proc = mpctx.Process(
            target=run_engine_core,
            args=(config, core_in, core_out, child_conn, os.getpid(), log_level),
            name="deja-engine-core",
            daemon=True,
        )
        self._proc.start()
        for conn in (child_conn, core_in, core_out):
            conn.close()
        try:
            msg = _wait_ready(parent_conn, self._proc, start_timeout_s)
        except BaseException:
            self._stop_process(0.0)
            self._close_pipes()
            raise
        _, self._model_info, self._stats = msg
        self.tokenizer = load_tokenizer(config.model.path)
        self._inputs = InputProcessor(self.tokenizer, self._model_info, config.scheduler)

    @classmethod
    def from_config(cls, config: EngineConfig, *, stream_buffer: int = 1024) -> EngineCoreClient:
        """Starts the core and waits until its model is loaded (blocking)."""
        return cls(config, stream_buffer=stream_buffer)

    # -- facts ---------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The engine core's process id."""
        return self._proc.pid

    @property
    def errored(self) -> bool:
        if self._dead is None and not self._proc.is_alive():
            self._mark_dead(f"the engine core process exited with code {self._proc.exitcode}")
        return self._dead is not None

    def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(self._dead)

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to do: the core runs from construction (kept for AsyncEngine's interface)."""

    def shutdown(self, flush_timeout_s: float | None = None) -> None:
        """Aborts what is in flight, lets the core flush its disk writes (at most
        `flush_timeout_s`; None: all of them), and stops it; kills it if it does not stop in
        time."""
        if self._proc.is_alive():
            with contextlib.suppress(Exception):
                self._send(("shutdown", flush_timeout_s))
        self._stop_process((600.0 if flush_timeout_s is None else flush_timeout_s) + 10.0)
        self._mark_dead("the engine was shut down", quiet=True)
        self._detach()
        self._close_pipes()

    # -- requests ------------------------------------------------------------------------------
    def _open(
        self, request_id: str | None, inputs: dict[str, Any]
    ) -> AsyncGenerator[RequestOutput, None]:
        self._attach()
        rid = request_id or f"creq-{next(self._ids)}"
        req = self._inputs.prepare(request_id=rid, **inputs)
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        stream = _Stream(
            req.prompt_token_ids,
            asyncio.Queue(),
            RequestText(self.tokenizer, req.prompt_token_ids, req.params),
        )
        self._streams[rid] = stream

        def leave(finished: bool) -> None:
            self._streams.pop(rid, None)
            if not finished and self._dead is None:
                self._send_abort([rid])

        return read_outputs(stream.queue, start=lambda: self._send(("add", req)), leave=leave)

    def abort(self, request_id: str) -> bool:
        """Aborts a request; the core frees its blocks before its next step."""
        if self._dead is None:
            self._send_abort([request_id])
        return request_id in self._streams

    async def call(self, name: str, *args: Any) -> Any:
        """Runs a read-only LLMEngine method (engine.core.core_process.CALLS) in the core, between steps."""
        self.check_health()
        self._attach()
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send(("call", call_id, name, args))
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
        """Calls `sink(batch)` on the event loop for each KV-event batch the core sends, in order
        (None: drop them). One sink at a time; the last one set wins."""
        self._kv_sink = sink

    # -- plumbing ------------------------------------------------------------------------------
    def _send(self, msg: tuple[Any, ...]) -> None:
        try:
            self._in.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as e:  # BrokenPipeError: the core is gone
            self._mark_dead(f"the engine core is unreachable: {e!r}")
            raise EngineDeadError(self._dead) from e

    def _send_abort(self, request_ids: list[str]) -> None:
        """Aborts never raise: with the core gone there is nothing left to abort."""
        with contextlib.suppress(EngineDeadError):
            self._send(("abort", request_ids))

    def _attach(self) -> None:
        """Reads the core's outputs on the running loop (once per loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        self._detach()
        self._loop = loop
        loop.add_reader(self._out.fileno(), self._on_readable)
        with contextlib.suppress(NotImplementedError, ValueError, OSError):
            loop.add_reader(self._proc.sentinel, self._on_core_exit)

    def _detach(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                loop.remove_reader(self._out.fileno())
            with contextlib.suppress(Exception):
                loop.remove_reader(self._proc.sentinel)

    def _on_core_exit(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._proc.sentinel)
        self._proc.join(timeout=1.0)
        # Outputs the core sent just before it died are still in the pipe: read them first.
        self._on_readable()
        _ = self.errored

    def _on_readable(self) -> None:
        """Everything the core has written so far, dispatched in order (event loop thread)."""
        try:
            while self._out.poll():
                self._dispatch(pickle.loads(self._out.recv_bytes()))
        except (EOFError, OSError):
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(self._out.fileno())
            self._proc.join(timeout=1.0)
            self._mark_dead(f"the engine core process exited with code {self._proc.exitcode}")

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "outputs":
            for packed in msg[1]:
                self._deliver(packed)
            if msg[2] is not None:
                self._stats = msg[2]
            if msg[3] is not None and self._kv_sink is not None:
                self._kv_sink(msg[3])
        elif kind == "rejected":
            self._push(msg[1], ValueError(msg[2]))
        elif kind == "result":
            fut = self._calls.get(msg[1])
            if fut is not None and not fut.done():
                if msg[2]:
                    fut.set_result(msg[3])
                else:
                    fut.set_exception(RuntimeError(msg[3]))
        elif kind == "failed":
            self._mark_dead(msg[1])

    def _deliver(self, packed: PackedOutput) -> None:
        rid = packed[0]
        stream = self._streams.get(rid)
        if stream is None:
            if not packed[2]:  # nobody listens (the caller left): stop the request
                self._send_abort([rid])
            return
        if stream.closed:
            return
        out = unpack_output(packed, stream.prompt_token_ids)
        stream.text.apply(out)
        if stream.queue.qsize() >= self.stream_buffer and not out.finished:
            stream.closed = True
            self._send_abort([rid])
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

    def _stop_process(self, timeout_s: float) -> None:
        self._proc.join(timeout=timeout_s)
        if self._proc.is_alive():
            log.warning("engine core did not stop in %.0f s; killing it", timeout_s)
            self._proc.kill()
            self._proc.join(timeout=5.0)

    def _close_pipes(self) -> None:
        for conn in (self._in, self._out):
            with contextlib.suppress(Exception):
                conn.close()


def _wait_ready(conn: Any, proc: Any, timeout_s: float) -> tuple[Any, ...]:
    """The core's ("ready", ModelInfo, EngineStats); raises RuntimeError with its reason."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] == "ready":
                return tuple(msg)
            raise RuntimeError(f"the engine core failed to start: {msg[1]}")
        if not proc.is_alive():
            break
    if proc.is_alive():
        raise RuntimeError(f"the engine core did not load its model within {timeout_s:.0f} s")
    raise RuntimeError(f"the engine core exited with code {proc.exitcode} while starting")
