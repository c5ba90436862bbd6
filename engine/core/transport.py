"""How commands reach the engine core and its messages reach the front end: one interface, two
implementations (engine/core/messages.py has the messages).

`InprocChannel`: the core loop runs in a thread of the front end's process; commands go through a
queue with a wake-up event, messages through a callback the front end gives (it hands them to its
event loop). `PipeTransport`: the core loop runs in a process of its own (engine/core/
core_process.py); both directions are OS pipes (multiprocessing Connections), read and written by
the calling thread itself: no I/O threads. On a 2-core host every extra thread wake-up per token
preempts one of torch's two OpenMP workers and stalls the whole step (measured: ZMQ, with an I/O
thread on each side, served 0.88x of offline decode; pipes 0.98x; docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from engine.core.messages import (
    Command,
    CoreMessage,
    Outputs,
    PackedOutput,
    pack_output,
    unpack_output,
)
from engine.kv.events import KVEventBatch
from engine.stats import EngineStats

PIPE_BYTES = 1 << 20
"""Pipe buffer asked of the kernel (F_SETPIPE_SZ), so a slow reader does not block a step."""


class CoreTransport(Protocol):
    """The core loop's side."""

    def receive(self, timeout_s: float) -> list[Command]:
        """Every command waiting, in order; when none is, waits up to `timeout_s` for one."""
        ...

    def send(self, msg: CoreMessage) -> None: ...

    def front_end_alive(self) -> bool:
        """False once the front end is gone (the core then shuts down)."""
        ...


class InprocChannel:
    """Both sides of an in-process core: `submit` from any front-end thread, `receive` and
    `send` from the core loop's thread (which calls `deliver` with each message)."""

    def __init__(self, deliver: Callable[[CoreMessage], None]) -> None:
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._deliver = deliver

    def submit(self, cmd: Command) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def receive(self, timeout_s: float) -> list[Command]:
        self._wake.clear()
        out = self._drain()
        if not out and timeout_s:
            self._wake.wait(timeout_s)
            out = self._drain()
        return out

    def _drain(self) -> list[Command]:
        out = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self._commands.get_nowait())
        return out

    def send(self, msg: CoreMessage) -> None:
        self._deliver(msg)

    def front_end_alive(self) -> bool:
        return True


@dataclass(slots=True)
class _PackedOutputs:
    """Outputs on the pipe: deltas as plain tuples."""

    outputs: list[PackedOutput]
    stats: EngineStats | None
    kv_events: KVEventBatch | None


def encode(msg: Any) -> bytes:
    """A command or message as bytes for the pipe (a step's deltas packed first)."""
    if isinstance(msg, Outputs):
        msg = _PackedOutputs([pack_output(o) for o in msg.outputs], msg.stats, msg.kv_events)
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    msg = pickle.loads(data)
    if isinstance(msg, _PackedOutputs):
        return Outputs([unpack_output(p) for p in msg.outputs], msg.stats, msg.kv_events)
    return msg


def widen_pipe(conn: Connection) -> None:
    """Best effort: a larger kernel buffer for a pipe end (Linux F_SETPIPE_SZ)."""
    import fcntl

    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)


@dataclass(eq=False)
class PipeTransport:
    """The core process's side of its two pipes."""

    inputs: Connection
    """Commands from the front end."""
    outputs: Connection
    """Messages to the front end."""
    parent_pid: int
    """The API server's pid; the core shuts down when its parent is no longer this process."""

    def receive(self, timeout_s: float) -> list[Command]:
        if timeout_s and not self.inputs.poll(timeout_s):
            return []
        out = []
        while self.inputs.poll():
            out.append(decode(self.inputs.recv_bytes()))
        return out

    def send(self, msg: CoreMessage) -> None:
        self.outputs.send_bytes(encode(msg))

    def front_end_alive(self) -> bool:
        return os.getppid() == self.parent_pid
