"""The engine core's busy loop (vLLM V1's EngineCoreProc.run_busy_loop), written once for the
core in a thread of the API server (engine/frontend/engine_client.py's AsyncEngine) and the core
in a process of its own (engine/core/core_process.py); only the transport differs.

Each turn: take every command waiting (without blocking while there is work), then either step
and send the step's deltas, or, idle, release expired pins, trim host memory, send fresh stats
and block briefly for the next command. The loop never waits on I/O while it has work; a step's
outputs are one message. Stats ride with outputs at most every STATS_INTERVAL_S, and at once
when a request arrives or finishes; KV events ride with the step that made them.

Shutdown (a Shutdown command, or the front end gone): abort everything, step until nothing is in
flight, flush the disk tier, send the last stats. A failure (a step raised, a tensor-parallel
worker died) is sent as Failed before the loop raises it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.core.engine_core import EngineCore
from engine.core.messages import (
    CALLS,
    AbortRequests,
    AddRequest,
    Call,
    CallResult,
    Command,
    Failed,
    Outputs,
    Rejected,
    Shutdown,
)
from engine.core.transport import CoreTransport
from engine.outputs import RequestOutput

log = logging.getLogger("deja.engine_core")

IDLE_POLL_S = 0.1
"""How long an idle core blocks for a command before its housekeeping (pins, memory, parent)."""
STATS_INTERVAL_S = 0.05
"""While busy, stats ride along with outputs at most this often, and with the first batch after a
request arrives or finishes; always once the core idles."""
TP_DEATH_WAIT_S = 1.0
"""After a failed step with tensor parallelism: how long to wait for a worker's exit to name it
as the cause (a collective with a dead peer can fail before the exit is seen)."""


@dataclass(eq=False, repr=False)
class CoreLoop:
    """Drives one EngineCore from a transport's commands until Shutdown or the front end's end."""

    engine: EngineCore
    transport: CoreTransport
    _stats_dirty: bool = field(default=True, init=False)
    """Something changed since the last stats sent (sent when the core goes idle)."""
    _stats_urgent: bool = field(default=False, init=False)
    """A request arrived or finished: blocks changed hands; send stats with the next batch."""
    _stats_sent_at: float = field(default=0.0, init=False)
    _stopping: bool = field(default=False, init=False)
    _flush_timeout_s: float | None = field(default=None, init=False)

    def run(self) -> None:
        """Returns after a shutdown (queues flushed); a failure is sent, then raised."""
        try:
            self._busy_loop()
            self._shutdown()
        except BaseException as e:
            self._send_failure(e)
            raise

    def _busy_loop(self) -> None:
        eng = self.engine
        while not self._stopping:
            busy = eng.has_unfinished_requests()
            for cmd in self.transport.receive(0.0 if busy else IDLE_POLL_S):
                self._handle(cmd)
            if not eng.has_unfinished_requests():
                self._idle()
                continue
            started = time.monotonic()
            outs = eng.step()
            self._stats_dirty = True
            self._send_outputs(outs)
            eng.step_rates.count_busy(time.monotonic() - started)

    def _idle(self) -> None:
        eng = self.engine
        if eng.expire_pins():  # pinned blocks are released when their TTL passes
            self._stats_dirty = True
        eng.trim_host_memory()
        if eng.publish_tier_writes() or self._stats_dirty:
            self._send_outputs([], force_stats=self._stats_dirty)
        if not self.transport.front_end_alive():
            log.warning("the API server exited; engine core shutting down")
            self._stopping, self._flush_timeout_s = True, 10.0

    def _shutdown(self) -> None:
        eng = self.engine
        for rid in list(eng.requests):
            eng.abort(rid)
        while eng.has_unfinished_requests():
            self._send_outputs(eng.step())
        eng.close(self._flush_timeout_s)
        self._send_outputs([], force_stats=True)

    def _handle(self, cmd: Command) -> None:
        eng = self.engine
        self._stats_dirty = True
        if isinstance(cmd, AddRequest):
            self._stats_urgent = True
            try:
                eng.enqueue(cmd.request)
            except ValueError as e:
                self.transport.send(Rejected(cmd.request.request_id, str(e)))
        elif isinstance(cmd, AbortRequests):
            if any([eng.abort(rid) for rid in cmd.request_ids]):
                # The final "abort" deltas now: blocks are free before the next step.
                self._send_outputs(eng.collect_outputs(), force_stats=True)
        elif isinstance(cmd, Call):
            self._call(cmd)
        elif isinstance(cmd, Shutdown):
            self._stopping, self._flush_timeout_s = True, cmd.flush_timeout_s

    def _call(self, cmd: Call) -> None:
        try:
            if cmd.name not in CALLS:
                raise ValueError(f"{cmd.name!r} is not a callable engine-core method")
            result = CallResult(cmd.call_id, True, getattr(self.engine, cmd.name)(*cmd.args))
        except Exception as e:
            result = CallResult(cmd.call_id, False, f"{type(e).__name__}: {e}")
        self.transport.send(result)

    def _send_outputs(self, outs: list[RequestOutput], *, force_stats: bool = False) -> None:
        now = time.monotonic()
        stats = None
        urgent = force_stats or self._stats_urgent or any(o.finished for o in outs)
        if urgent or now - self._stats_sent_at >= STATS_INTERVAL_S:
            stats = self.engine.get_stats()
            self._stats_sent_at = now
            self._stats_dirty = self._stats_urgent = False
        kv_events = self.engine.take_kv_events()
        if outs or stats is not None or kv_events is not None:
            self.transport.send(Outputs(outs, stats, kv_events))

    def _send_failure(self, error: BaseException) -> None:
        """Tells the front end why the core stops; a worker's death is named as the cause when
        a step failed in a collective because of it."""
        message = f"{type(error).__name__}: {error}"
        executor = self.engine.executor
        dead = None
        if executor.world > 1:
            executor.on_death = None  # this thread reports it
            dead = executor.dead_worker(TP_DEATH_WAIT_S)
        if dead is not None:
            log.error("%s (the step failed: %s); the engine core stops", dead, message)
            message = dead
        else:
            log.exception("engine core step loop failed")
        try:
            self.transport.send(Failed(f"the engine core failed: {message}"))
        except Exception:  # the front end may be gone too
            log.warning("could not tell the front end that the core failed")
