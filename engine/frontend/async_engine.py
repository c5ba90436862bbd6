"""`AsyncEngine`: the engine core's loop in a thread of this process (engine/core/core_loop.py
over an in-process channel), with the `EngineClient` interface (engine/frontend/engine_client.py).

Only the core loop's thread touches the EngineCore. Callers validate and tokenize in their own
thread, then hand requests and aborts to it through the channel's queue; its messages come back
through one `call_soon_threadsafe` per step onto the event loop that streams them.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from engine.config import EngineConfig
from engine.core.core_loop import CoreLoop
from engine.core.engine_core import EngineCore
from engine.core.messages import Command, CoreMessage, Failed, Outputs, Shutdown
from engine.core.transport import InprocChannel
from engine.frontend.engine_client import EngineClient
from engine.frontend.input_processor import InputProcessor

log = logging.getLogger(__name__)


class AsyncEngine(EngineClient):
    """An EngineCore stepped by a background thread; call `start()` before generating."""

    _id_prefix = "areq"

    def __init__(self, engine: EngineCore, *, stream_buffer: int = 1024) -> None:
        inputs = InputProcessor(engine.tokenizer, engine.model_info, engine.config.scheduler)
        super().__init__(
            engine.tokenizer, engine.model_info, engine.get_stats(), inputs,
            stream_buffer=stream_buffer,
        )  # fmt: skip
        self.engine = engine
        self._channel = InprocChannel(self._post)
        self._core_loop = CoreLoop(engine, self._channel)
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, *, stream_buffer: int = 1024) -> AsyncEngine:
        """Loads the model (blocking) and builds the engine; call `start()` before generating."""
        return cls(EngineCore(config), stream_buffer=stream_buffer)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="deja-engine", daemon=True)
            self._thread.start()

    def shutdown(self, flush_timeout_s: float | None = None) -> None:
        """Aborts everything in flight, flushes the disk tier's queued writes (at most
        `flush_timeout_s`; None: all of them) and stops the core's thread."""
        self._channel.submit(Shutdown(flush_timeout_s))
        if self._thread is not None:
            self._thread.join(timeout=30 + (flush_timeout_s or 0.0))
            self._thread = None

    def _run(self) -> None:
        with contextlib.suppress(BaseException):  # CoreLoop.run sent the failure and logged it
            self._core_loop.run()

    def _submit(self, cmd: Command) -> None:
        self._channel.submit(cmd)

    def _post(self, msg: CoreMessage) -> None:
        """The core thread's messages, handed to the event loop that streams them."""
        loop = self._loop
        if loop is None or loop.is_closed():  # nobody streams yet: keep what matters
            if isinstance(msg, Outputs) and msg.stats is not None:
                self._stats = msg.stats
            elif isinstance(msg, Failed):
                self._mark_dead(msg.message)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._dispatch, msg)
