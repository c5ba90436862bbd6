"""The engine core: the step loop in a process of its own (vLLM V1's EngineCoreProc).

    API-server process                         engine-core process (this module)
    ------------------                         ---------------------------------
    EngineCoreClient  --pipe (inputs)--->      add / abort / call / shutdown
                      <--pipe (outputs)--      outputs (+ stats) / results / failure

Why a process: on a small CPU host, torch work driven from a thread other than the one that
loaded the model, sharing a GIL with the gRPC event loop, decoded at about half the speed of the
same engine in the main thread (measured; see docs/architecture.md). Here every torch call, from
loading the weights to the last step, runs in this process's main thread, and the API server's
Python work (gRPC, protobuf, tokenization) never takes this loop's GIL.

The channel is a pair of OS pipes (multiprocessing Connections), read and written by the calling
thread itself: no I/O threads. On a 2-core host every extra thread wake-up per token preempts one
of torch's two OpenMP workers and stalls the whole step (measured: ZMQ, with an I/O thread on each
side, served 0.88x of offline decode; pipes 0.98x — docs/architecture.md). The loop never waits on I/O while it has work: commands are drained
without blocking before each step, and a step's outputs are one small write into a 1 MiB pipe
buffer. Only an idle core blocks, in a poll with a short timeout, so it also notices a dead
parent.

Messages are pickled tuples (both ends are this codebase, on one host):
    in:  ("add", Request) | ("abort", [request_id, ...]) | ("call", call_id, name, args)
         | ("shutdown", flush_timeout_s)
    out: ("outputs", [PackedOutput, ...], EngineStats | None, KVEventBatch | None)
         | ("rejected", request_id, message)
         | ("result", call_id, ok, value) | ("failed", message)
Deltas travel as plain tuples, without their prompt's token ids (the client has them) or
their text (the client makes it): see `pack_output`.
KV events (engine/kv/events.py) are taken once per step, after the step, and ride in the same
message as that step's outputs (one batch, numbered by the engine).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from engine.config import EngineConfig
from engine.outputs import (
    CachedTokens,
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)

log = logging.getLogger("deja.engine_core")

IDLE_POLL_S = 0.1
"""How long an idle core blocks for a command before checking on its parent."""
TP_DEATH_WAIT_S = 1.0
"""After a failed step with tensor parallelism: how long to wait for a worker's exit to name
it as the cause (a collective with a dead peer can fail before the exit is seen)."""
PIPE_BYTES = 1 << 20
"""Pipe buffer asked of the kernel (F_SETPIPE_SZ), so a slow reader does not block a step."""
STATS_INTERVAL_S = 0.05
"""While busy, stats ride along with outputs at most this often, and with the first batch after a
request arrives or finishes; always once the core idles."""
CALLS = frozenset({"cached_block_hashes", "get_stats", "kv_snapshot"})
"""EngineCore methods a client may `call` (read-only, step-thread only)."""


def freeze_gc_heap() -> None:
    """Moves every object alive now (the loaded model, tokenizer, block pool, imported modules:
    ~400k objects) out of the cyclic garbage collector's reach, as vLLM's engine core does after
    it starts. Python's full collections otherwise walk them all, and a step that triggers one
    took milliseconds longer (measured: `deja bench step` at batch 256, the core's output phase
    2.8 ms a step on average against 0.8 with collections of the frozen heap). Objects made
    later are collected as usual. For a process that keeps its engine to the end: frozen
    objects are never freed."""
    import gc

    gc.collect()
    gc.freeze()


def widen_pipe(conn: Connection) -> None:
    """Best effort: a larger kernel buffer for a pipe end (Linux F_SETPIPE_SZ)."""
    import contextlib
    import fcntl

    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)


PackedSample = tuple[
    int,  # index
    list[int],  # token_ids
    list[tuple[int, float, list[tuple[int, float]]]] | None,  # logprobs: (token_id, logprob, top)
    str | None,  # finish_reason
    int | str | None,  # stop_reason
    float | None,  # cumulative_logprob
]
PackedOutput = tuple[
    str,  # request_id
    list[PackedSample],  # outputs (deltas)
    bool,  # finished
    tuple[int, int, int],  # cached_tokens: device, cpu, disk
    tuple[float, float | None, float | None, float | None] | None,  # metrics
    str | None,  # error
    bool | None,  # pinned
]
"""A delta on the wire: plain tuples, lists and numbers. Pickle takes ~10x longer over the
dataclasses themselves (measured, 256 one-token deltas: dumps 0.63 against 0.07 ms, plus 0.07 ms
to pack them, in the core's step loop; loads 0.44 against 0.08 ms in the API server), so the core
sends these and the client rebuilds the objects."""


def pack_output(out: RequestOutput) -> PackedOutput:
    c, m = out.cached_tokens, out.metrics
    return (
        out.request_id,
        [
            (
                s.index,
                s.token_ids,
                None
                if s.logprobs is None
                else [(lp.token_id, lp.logprob, lp.top) for lp in s.logprobs],
                s.finish_reason,
                s.stop_reason,
                s.cumulative_logprob,
            )
            for s in out.outputs
        ],
        out.finished,
        (c.device, c.cpu, c.disk),
        None if m is None else (m.arrival, m.first_scheduled, m.first_token, m.finished),
        out.error,
        out.pinned,
    )


def unpack_output(packed: PackedOutput, prompt_token_ids: list[int]) -> RequestOutput:
    rid, samples, finished, cached, metrics, error, pinned = packed
    cached_tokens = CachedTokens(*cached)
    return RequestOutput(
        rid,
        prompt_token_ids,
        [
            CompletionOutput(
                index,
                "",
                token_ids,
                None if lps is None else [TokenLogprob(*lp) for lp in lps],
                finish_reason,
                stop_reason,
                cum,
            )
            for index, token_ids, lps, finish_reason, stop_reason, cum in samples
        ],
        finished,
        cached_tokens.total,
        cached_tokens,
        None if metrics is None else RequestMetrics(*metrics),
        error,
        pinned,
    )


@dataclass(eq=False, repr=False)
class EngineCoreProc:
    """Drives one EngineCore from pipe commands until shutdown or the parent's death."""

    engine: Any
    inputs: Connection
    """Commands from the client (read by `_drain`)."""
    outputs: Connection
    """Messages to the client (written by `_send`)."""
    parent_pid: int
    """The API server's pid; the core shuts down when its parent is no longer this process."""
    _stats_dirty: bool = field(default=True, init=False)
    """Something changed since the last stats sent (sent when the core goes idle)."""
    _stats_urgent: bool = field(default=False, init=False)
    """A request arrived or finished: blocks changed hands; send stats with the next batch."""
    _stats_sent_at: float = field(default=0.0, init=False)
    _stopping: bool = field(default=False, init=False)
    _flush_timeout_s: float | None = field(default=None, init=False)

    def run(self) -> None:
        """The busy loop: drain commands, step, send; returns after shutdown (queues flushed)."""
        eng = self.engine
        while not self._stopping:
            busy = eng.has_unfinished_requests()
            self._drain(0.0 if busy else IDLE_POLL_S)
            if not eng.has_unfinished_requests():
                if eng.expire_pins():  # idle: pinned blocks are released when their TTL passes
                    self._stats_dirty = True
                eng.trim_host_memory()
                if self._stats_dirty:
                    self._send_outputs([], force_stats=True)
                if os.getppid() != self.parent_pid:
                    log.warning("the API server exited; engine core shutting down")
                    self._stopping, self._flush_timeout_s = True, 10.0
                continue
            started = time.monotonic()
            outs = eng.step()
            self._stats_dirty = True
            self._send_outputs(outs)
            eng.step_rates.count_busy(time.monotonic() - started)
        for rid in list(eng.requests):
            eng.abort(rid)
        while eng.has_unfinished_requests():
            self._send_outputs(eng.step())
        eng.close(self._flush_timeout_s)
        self._send_outputs([], force_stats=True)

    def _drain(self, timeout_s: float) -> None:
        if timeout_s and not self.inputs.poll(timeout_s):
            return
        while self.inputs.poll():
            self._handle(pickle.loads(self.inputs.recv_bytes()))

    def _handle(self, msg: tuple[Any, ...]) -> None:
        eng = self.engine
        kind = msg[0]
        self._stats_dirty = True
        if kind == "add":
            self._stats_urgent = True
            try:
                eng.enqueue(msg[1])
            except ValueError as e:
                self._send(("rejected", msg[1].request_id, str(e)))
        elif kind == "abort":
            if any([eng.abort(rid) for rid in msg[1]]):
                # Deliver the final "abort" deltas now: blocks are free before the next step.
                self._send_outputs(eng.collect_outputs(), force_stats=True)
        elif kind == "call":
            _, call_id, name, args = msg
            try:
                if name not in CALLS:
                    raise ValueError(f"{name!r} is not a callable engine-core method")
                self._send(("result", call_id, True, getattr(eng, name)(*args)))
            except Exception as e:
                self._send(("result", call_id, False, f"{type(e).__name__}: {e}"))
        elif kind == "shutdown":
            self._stopping, self._flush_timeout_s = True, msg[1]

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
            self._send(("outputs", [pack_output(o) for o in outs], stats, kv_events))

    def _send(self, msg: tuple[Any, ...]) -> None:
        self.outputs.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def run_engine_core(
    config: EngineConfig,
    inputs: Connection,
    outputs: Connection,
    ready: Connection,
    parent_pid: int,
    log_level: int = logging.INFO,
) -> None:
    """The engine-core process's entry point (multiprocessing target, spawn context).

    Loads the model in this process's main thread, answers ("ready", ModelInfo, EngineStats) or
    ("failed", message) on `ready`, then runs the loop. Exits 0 after a shutdown command or the
    parent's death, 1 when loading or a step fails (after telling the client why).
    """
    # The API server owns the signals: Ctrl-C in a terminal reaches the whole process group, and
    # the server drains before it tells the core to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level,
        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s",
        stream=sys.stderr,
    )
    try:
        from engine.core.engine_core import EngineCore

        engine = EngineCore(config)
    except BaseException as e:
        log.exception("engine core failed to start")
        ready.send(("failed", f"{type(e).__name__}: {e}"))
        ready.close()
        sys.exit(1)
    if engine.tp is not None:
        engine.tp.on_death = _tp_worker_died
    widen_pipe(outputs)
    freeze_gc_heap()
    ready.send(("ready", engine.model_info, engine.get_stats()))
    ready.close()
    core = EngineCoreProc(engine, inputs, outputs, parent_pid)
    code = 0
    try:
        core.run()
    except BaseException as e:
        message = f"{type(e).__name__}: {e}"
        dead = None
        if engine.tp is not None:
            engine.tp.on_death = None  # this thread reports it (below)
            dead = engine.tp.dead_worker(TP_DEATH_WAIT_S)
        if dead is not None:  # the step failed in a collective because a worker died
            log.error("%s (the step failed: %s); the engine core exits", dead, message)
            message = dead
        else:
            log.exception("engine core step loop failed")
        core._send(("failed", f"the engine core failed: {message}"))
        code = 1
    outputs.close()
    inputs.close()
    sys.exit(code)


def _tp_worker_died(message: str) -> None:
    """A tensor-parallel worker died (the executor's watch thread): the core exits at once, so
    the API server sees a dead engine (NOT_SERVING, open streams fail, `deja serve` exits 1)
    instead of a step loop stuck in, or failing, collectives."""
    log.error("%s; the engine core exits", message)
    os._exit(1)
