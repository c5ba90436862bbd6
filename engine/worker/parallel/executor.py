"""Rank 0's side of tensor parallelism (vLLM V1's multiprocess executor, reduced): starts ranks
1..N-1 as worker processes, joins their group, sends each step, and watches them.

The scheduler and the KV manager stay single, in the engine core; rank 0's model runner runs in
the core's thread as with N=1 and calls `send_step` before each forward, so every rank runs the
same forward over its own heads and block ids are the same on every rank. A worker that dies
marks the executor failed (the next step raises instead of waiting) and calls `on_death` within
WATCH_INTERVAL_S; the engine-core process sets it to exit, which the API server already treats
as a dead engine (health NOT_SERVING, open streams fail, `deja serve` exits 1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.kv.hashing import BlockHash
from engine.kv.plan import KVPlan
from engine.kv_io.offload import DiskOp, KVOffload
from engine.worker.attention.kv_quant import KVScales
from engine.worker.parallel.group import TPGroup, check_shapes, init_group
from engine.worker.parallel.step import StepBatch, StepMessage
from engine.worker.parallel.worker import WorkerSpec

log = logging.getLogger("deja.tp")

WATCH_INTERVAL_S = 0.1
READY_TIMEOUT_S = 1800.0
"""Longest a worker may take to load its shard."""


def _spawn(spec: WorkerSpec) -> tuple[subprocess.Popen[bytes], Connection]:
    """`python -m engine.worker.parallel.worker FD` with one end of a socket pair as FD.

    NOTE: a subprocess, not multiprocessing: the engine core is itself a daemonic
    multiprocessing child, and those may not start children of their own."""
    mine, theirs = socket.socketpair()
    root = str(Path(__file__).resolve().parents[3])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "engine.worker.parallel.worker", str(theirs.fileno())]
    proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=env)
    theirs.close()
    conn = Connection(mine.detach())
    conn.send_bytes(pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
    return proc, conn


STOP_WAIT_S = 60.0
"""How long a stopping worker may take (it flushes its disk tier's queued writes) before it is
killed."""


def _stop(procs: list[subprocess.Popen[bytes]], conns: list[Connection], store_dir: str) -> None:
    for conn in conns:
        with contextlib.suppress(Exception):
            conn.send_bytes(pickle.dumps(("stop",)))
        with contextlib.suppress(Exception):
            conn.close()
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shutil.rmtree(store_dir, ignore_errors=True)


class TPExecutor:
    """Ranks 1..N-1 of one engine, and rank 0's group."""

    def __init__(self, config: EngineConfig, hf_config: Any, device: torch.device) -> None:
        from engine.worker.models import get_model_class

        world = config.tensor_parallel_size
        cls = get_model_class(hf_config)
        check_shapes(hf_config, world, cls.supports_tensor_parallel, cls.__name__)
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(
                f"tensor_parallel_size={world} needs {world} CUDA devices, "
                f"found {torch.cuda.device_count()}"
            )
        threads = config.num_threads or max(1, len(os.sched_getaffinity(0)) // world)
        torch.set_num_threads(threads)
        self.world = world
        self.failed: str | None = None
        self.on_death: Callable[[str], None] | None = None
        """Called once, from the watch thread, with the message of a worker's death."""
        self._closing = False
        self._store_dir = tempfile.mkdtemp(prefix="deja-tp-")
        store = os.path.join(self._store_dir, "store")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._store_dir)
        for rank in range(1, world):
            spec = WorkerSpec(config, rank, world, store, device.type, threads, os.getpid())
            proc, conn = _spawn(spec)
            self.procs.append(proc)
            self.conns.append(conn)
        self.group: TPGroup = init_group(0, world, store, device)
        self._disk_ops: list[DiskOp] | None = None
        """Rank 0's offload's record of disk writes and deletes (the same list)."""

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (ranks 1..N-1)."""
        return [p.pid for p in self.procs]

    def calibrate(self, prompts: list[list[int]]) -> None:
        """Starts the fp8 KV-scale calibration pass on the workers (engine/worker/
        kv_calibration.py); rank 0 then runs its own, and the passes meet in their collectives."""
        self._send(("calibrate", prompts))

    def allocate(
        self,
        num_device_blocks: int,
        num_cpu_blocks: int,
        offload: KVOffload | None = None,
        kv_scales: KVScales | None = None,
    ) -> None:
        """Tells the workers the pool sizes, the fp8 cache's scales (None: the model's dtype)
        and rank 0's disk manifest (each worker opens its own folder), waits until every one has
        loaded, starts watching."""
        manifest = None
        if offload is not None and offload.disk is not None:
            manifest = offload.disk_manifest
            offload.disk.peers_probe = self.probe
            self._disk_ops = offload.disk_ops
        scales = None if kv_scales is None else kv_scales.to_json()
        msg = pickle.dumps(("alloc", num_device_blocks, num_cpu_blocks, manifest, scales))
        for conn in self.conns:
            conn.send_bytes(msg)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), 1):
            while not conn.poll(0.2):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} did not start (exit {proc.poll()})"
                    )
            reply = pickle.loads(conn.recv_bytes())
            if reply[0] != "ready":
                raise RuntimeError(f"tensor-parallel worker failed to start: {reply[1]}")
        threading.Thread(target=self._watch, name="deja-tp-watch", daemon=True).start()

    def send_step(self, plan: KVPlan, batch: StepBatch | None, logit_rows: list[int]) -> None:
        """Sends one step to every worker (before rank 0's own forward)."""
        self._send(("step", StepMessage(plan, batch, logit_rows)))

    def _send(self, msg: tuple[Any, ...]) -> None:
        """To every worker, after the disk writes and deletes recorded since the last message
        (so a worker repeats them between the same two steps as rank 0)."""
        if self.failed is not None:
            raise RuntimeError(self.failed)
        data = [pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)]
        if self._disk_ops:
            data.insert(0, pickle.dumps(("disk", list(self._disk_ops))))
            self._disk_ops.clear()
        try:
            for conn in self.conns:
                for d in data:
                    conn.send_bytes(d)
        except OSError as e:
            raise RuntimeError(f"a tensor-parallel worker is unreachable: {e!r}") from e

    def probe(self, block_hash: BlockHash) -> bool:
        """Whether every worker holds its share of the block on disk (verified into its read
        buffer for this step's load); rank 0's disk files ask before counting a hit."""
        self._send(("probe", block_hash))
        found = True
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), 1):
            while not conn.poll(WATCH_INTERVAL_S):
                if proc.poll() is not None or self.failed is not None:
                    raise RuntimeError(self.failed or f"tensor-parallel rank {rank} exited")
            found = pickle.loads(conn.recv_bytes())[1] and found
        return found

    def _dead(self) -> str | None:
        for rank, proc in enumerate(self.procs, 1):
            code = proc.poll()
            if code is not None:
                return (
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                    f"{code}; the engine cannot step without it"
                )
        return None

    def _watch(self) -> None:
        while not self._closing:
            dead = self._dead()
            if dead is not None and not self._closing:
                self.failed = dead
                log.error("%s", self.failed)
                if self.on_death is not None:
                    self.on_death(self.failed)
                return
            time.sleep(WATCH_INTERVAL_S)

    def dead_worker(self, timeout_s: float) -> str | None:
        """Why a step failed, when a worker died: a collective with a dead peer often fails
        (connection reset) before the watch thread sees the exit. Waits up to `timeout_s` for an
        exit; the message, or None when every worker lives."""
        deadline = time.monotonic() + timeout_s
        while True:
            dead = self.failed or self._dead()
            if dead is not None or time.monotonic() >= deadline:
                return dead
            time.sleep(WATCH_INTERVAL_S / 4)

    def close(self) -> None:
        """Stops the workers (they flush their disk writes; killed after STOP_WAIT_S)."""
        self._closing = True
        if self._disk_ops and self.failed is None:
            with contextlib.suppress(Exception):
                self._send(("disk-only",))
        self._finalizer()


def tp_executor(config: EngineConfig, hf_config: Any, device: torch.device) -> TPExecutor | None:
    """Ranks 1..N-1 and rank 0's group under tensor parallelism; None when N = 1 (the
    single-process path: no group, no collectives)."""
    if config.tensor_parallel_size == 1:
        return None
    return TPExecutor(config, hf_config, device)
