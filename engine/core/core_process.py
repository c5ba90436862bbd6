"""The engine core: the step loop in a process of its own (vLLM V1's EngineCoreProc).

    API-server process                         engine-core process (this module)
    ------------------                         ---------------------------------
    EngineCoreClient  --pipe (commands)-->     CoreLoop (engine/core/core_loop.py)
                      <--pipe (messages)--     over the same EngineCore as a thread's

Why a process: on a small CPU host, torch work driven from a thread other than the one that
loaded the model, sharing a GIL with the gRPC event loop, decoded at about half the speed of the
same engine in the main thread (measured; see docs/architecture.md). Here every torch call, from
loading the weights to the last step, runs in this process's main thread, and the API server's
Python work (gRPC, protobuf, tokenization) never takes this loop's GIL. The pipes
(engine/core/transport.py) are read and written by the calling thread itself: no I/O threads.

Messages are typed (engine/core/messages.py); the busy loop is engine/core/core_loop.py's, the
same as for a core in a thread; only its transport (two pipes) is this process's.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.config import EngineConfig
from engine.core.messages import Failed
from engine.core.transport import PipeTransport, widen_pipe
from engine.stats import EngineStats, ModelInfo

log = logging.getLogger("deja.engine_core")


@dataclass(frozen=True, slots=True)
class Ready:
    """The core's first message once its model is loaded (else Failed)."""

    model_info: ModelInfo
    stats: EngineStats


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


def run_engine_core(
    config: EngineConfig,
    inputs: Connection,
    outputs: Connection,
    ready: Connection,
    parent_pid: int,
    log_level: int = logging.INFO,
) -> None:
    """The engine-core process's entry point (multiprocessing target, spawn context).

    Loads the model in this process's main thread, answers Ready or Failed on `ready`, then runs
    the loop. Exits 0 after a shutdown command or the
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
        from engine.core.core_loop import CoreLoop
        from engine.core.engine_core import EngineCore

        engine = EngineCore(config)
    except BaseException as e:
        log.exception("engine core failed to start")
        ready.send(Failed(f"{type(e).__name__}: {e}"))
        ready.close()
        sys.exit(1)
    if engine.executor.world > 1:
        engine.executor.on_death = _tp_worker_died
    widen_pipe(outputs)
    freeze_gc_heap()
    ready.send(Ready(engine.model_info, engine.get_stats()))
    ready.close()
    code = 0
    try:
        CoreLoop(engine, PipeTransport(inputs, outputs, parent_pid)).run()
    except BaseException:
        code = 1  # the loop told the client why, and logged it
    outputs.close()
    inputs.close()
    if code:
        sys.exit(code)
    # NOTE: a clean stop has closed everything (the loop closed the engine: its workers, the
    # disk tier's writes). The interpreter's finalization would only print triton's nanobind
    # "leaked" reports (triton comes in through torch._dynamo when transformers' configs load).
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)


def _tp_worker_died(message: str) -> None:
    """A tensor-parallel worker died (the executor's watch thread): the core exits at once, so
    the API server sees a dead engine (NOT_SERVING, open streams fail, `deja serve` exits 1)
    instead of a step loop stuck in, or failing, collectives."""
    log.error("%s; the engine core exits", message)
    os._exit(1)
