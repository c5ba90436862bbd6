"""`EngineCoreClient`: the engine core in a process of its own (engine/core/core_process.py), with
the `EngineClient` interface (engine/frontend/engine_client.py).

Commands go down one pipe and the core's messages come up another (engine/core/transport.py);
the event loop reads the messages itself (`add_reader`), so no thread sits between the core and
the streams. A core that exits (killed, crashed, failed) fails every open stream with
EngineDeadError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import time
from typing import Any

from engine.config import EngineConfig
from engine.core.core_process import Ready, run_engine_core
from engine.core.messages import Command, Failed, Shutdown
from engine.core.transport import decode, encode, widen_pipe
from engine.errors import EngineDeadError
from engine.frontend.engine_client import EngineClient
from engine.frontend.input_processor import InputProcessor

log = logging.getLogger(__name__)


class EngineCoreClient(EngineClient):
    """Spawns the engine core, then serves `generate` / `abort` / stats like AsyncEngine."""

    _id_prefix = "creq"

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
        mpctx = mp.get_context("spawn")
        core_in, self._in = mpctx.Pipe(duplex=False)
        self._out, core_out = mpctx.Pipe(duplex=False)
        widen_pipe(self._in)
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
            ready = _wait_ready(parent_conn, self._proc, start_timeout_s)
        except BaseException:
            self._stop_process(0.0)
            self._close_pipes()
            raise
        tokenizer = load_tokenizer(config.model.path)
        inputs = InputProcessor(tokenizer, ready.model_info, config.scheduler)
        super().__init__(
            tokenizer, ready.model_info, ready.stats, inputs, stream_buffer=stream_buffer
        )

    @classmethod
    def from_config(cls, config: EngineConfig, *, stream_buffer: int = 1024) -> EngineCoreClient:
        """Starts the core and waits until its model is loaded (blocking)."""
        return cls(config, stream_buffer=stream_buffer)

    @property
    def pid(self) -> int | None:
        """The engine core's process id."""
        return self._proc.pid

    @property
    def errored(self) -> bool:
        if self._dead is None and not self._proc.is_alive():
            self._mark_dead(f"the engine core process exited with code {self._proc.exitcode}")
        return self._dead is not None

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to do: the core runs from construction (kept for AsyncEngine's interface)."""

    def shutdown(self, flush_timeout_s: float | None = None) -> None:
        """Aborts what is in flight, lets the core flush its disk writes (at most
        `flush_timeout_s`; None: all of them), and stops it; kills it if it does not stop in
        time."""
        if self._proc.is_alive():
            with contextlib.suppress(Exception):
                self._submit(Shutdown(flush_timeout_s))
        self._stop_process((600.0 if flush_timeout_s is None else flush_timeout_s) + 10.0)
        self._mark_dead("the engine was shut down", quiet=True)
        self._detach()
        self._close_pipes()

    # -- plumbing ------------------------------------------------------------------------------
    def _submit(self, cmd: Command) -> None:
        try:
            self._in.send_bytes(encode(cmd))
        except OSError as e:  # BrokenPipeError: the core is gone
            self._mark_dead(f"the engine core is unreachable: {e!r}")
            raise EngineDeadError(self._dead) from e

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
                self._dispatch(decode(self._out.recv_bytes()))
        except (EOFError, OSError):
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(self._out.fileno())
            self._proc.join(timeout=1.0)
            self._mark_dead(f"the engine core process exited with code {self._proc.exitcode}")

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


def _wait_ready(conn: Any, proc: Any, timeout_s: float) -> Ready:
    """The core's Ready message; raises RuntimeError with its reason."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                msg = conn.recv()
            except EOFError:
                break
            if isinstance(msg, Ready):
                return msg
            assert isinstance(msg, Failed)
            raise RuntimeError(f"the engine core failed to start: {msg.message}")
        if not proc.is_alive():
            break
    if proc.is_alive():
        raise RuntimeError(f"the engine core did not load its model within {timeout_s:.0f} s")
    raise RuntimeError(f"the engine core exited with code {proc.exitcode} while starting")
