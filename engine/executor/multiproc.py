"""Tensor parallelism's executor (vLLM V1's multiprocess executor, reduced): starts ranks 1..N-1
as worker processes, joins their group with rank 0's own worker, sends each step, and watches them.

The scheduler and the KV manager stay single, in the engine core; rank 0's worker runs in the
core's thread as with N=1 and its runner calls `send_step` before each forward, so every rank runs
the same forward over its own heads and block ids are the same on every rank. A worker that dies
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
from engine.executor.base import Executor
from engine.kv.hashing import BlockHash
from engine.kv.plan import KVPlan
from engine.kv_io.offload import DiskOp, KVOffload
from engine.worker.attention.kv_quant import KVScales
from engine.worker.model_loader import read_hf_config
from engine.worker.model_runner import StepHandle
from engine.worker.parallel import messages
from engine.worker.parallel.group import TPGroup, check_shapes, init_group
from engine.worker.step_record import StepRecord
from engine.worker.worker import Worker, rank_device

log = logging.getLogger("deja.tp")

WATCH_INTERVAL_S = 0.1
READY_TIMEOUT_S = 1800.0
"""Longest a worker may take to load its shard."""


def _spawn(spec: messages.WorkerSpec) -> tuple[subprocess.Popen[bytes], Connection]:
    """`python -m engine.worker.parallel.worker FD` with one end of a socket pair as FD.

    NOTE: a subprocess, not multiprocessing: the engine core is itself a daemonic
    multiprocessing child, and those may not start children of their own."""
    mine, theirs = socket.socketpair()
    root = str(Path(__file__).resolve().parents[2])
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
            conn.send_bytes(pickle.dumps(messages.Stop()))
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


class MultiprocExecutor(Executor):
    """Ranks 1..N-1 in worker processes, rank 0's worker (`driver`) here; one group."""

    def __init__(self, config: EngineConfig) -> None:
        from engine.worker.models import get_model_class

        world = config.tensor_parallel_size
        hf_config = read_hf_config(config.model.path)
        device = rank_device(config.device, 0)
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
        self._closing = False
        self._store_dir = tempfile.mkdtemp(prefix="deja-tp-")
        store = os.path.join(self._store_dir, "store")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._store_dir)
        for rank in range(1, world):
            spec = messages.WorkerSpec(config, rank, world, store, threads, os.getpid())
            proc, conn = _spawn(spec)
            self.procs.append(proc)
            self.conns.append(conn)
        self.group: TPGroup = init_group(0, world, store, device)
        self._disk_ops: list[DiskOp] | None = None
        """Rank 0's offload's record of disk writes and deletes (the same list)."""
        self.driver = Worker(config, self.group)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (ranks 1..N-1)."""
        return [p.pid for p in self.procs]

    def launch(self, record: StepRecord, in_flight: StepHandle | None = None) -> StepHandle:
        """Rank 0's runner sends the step to the workers before its own forward."""
        return self.runner.launch(record, in_flight, self.send_step)

    @property
    def peers_calibrate(self) -> Callable[[list[list[int]]], None]:
        return self._calibrate

    def _calibrate(self, prompts: list[list[int]]) -> None:
        """Starts the fp8 KV-scale calibration pass on the workers (engine/worker/
        kv_calibration.py); rank 0 then runs its own, and the passes meet in their collectives."""
        self._send(messages.Calibrate(prompts))

    def allocate_followers(
        self,
        num_device_blocks: int,
        num_cpu_blocks: int,
        offload: KVOffload | None,
        kv_scales: KVScales | None,
    ) -> None:
        """Tells the workers the pool sizes, the fp8 cache's scales (None: the model's dtype)
        and rank 0's disk manifest (each worker opens its own folder), waits until every one has
        loaded, starts watching."""
        manifest = remote = None
        if offload is not None and offload.disk is not None:
            manifest = offload.disk_manifest
            offload.disk.peers_probe = self.probe
        if offload is not None:
            self._disk_ops = offload.disk_ops
            remote = offload.remote_manifest
        scales = None if kv_scales is None else kv_scales.to_json()
        msg = pickle.dumps(
            messages.Allocate(num_device_blocks, num_cpu_blocks, manifest, remote, scales)
        )
        shares: list[tuple[bytes, int]] = []
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
            if isinstance(reply, messages.Failed):
                raise RuntimeError(f"tensor-parallel worker failed to start: {reply.message}")
            if reply.remote_share is not None:
                shares.append(reply.remote_share)
        if offload is not None and offload.remote is not None:
            offload.remote.peers = shares  # a remote hit needs every rank's share
        threading.Thread(target=self._watch, name="deja-tp-watch", daemon=True).start()

    def send_step(
        self, plan: KVPlan, batch: messages.StepBatch | None, logit_rows: list[int]
    ) -> None:
        """Sends one step to every worker (before rank 0's own forward), with the other ranks'
        shares of its remote loads."""
        shares = None
        if plan.remote_load:
            offload = self.driver.offload
            assert offload is not None and offload.remote is not None
            shares = {h: offload.remote.peer_shares(h) for h, _ in plan.remote_load}
        self._send(messages.Step(plan, batch, logit_rows, shares))

    def _send(self, msg: Any) -> None:
        """To every worker, after the disk writes and deletes recorded since the last message
        (so a worker repeats them between the same two steps as rank 0)."""
        if self.failed is not None:
            raise RuntimeError(self.failed)
        data = [] if msg is None else [pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)]
        if self._disk_ops:
            data.insert(0, pickle.dumps(messages.DiskOps(list(self._disk_ops))))
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
        self._send(messages.Probe(block_hash))
        found = True
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), 1):
            while not conn.poll(WATCH_INTERVAL_S):
                if proc.poll() is not None or self.failed is not None:
                    raise RuntimeError(self.failed or f"tensor-parallel rank {rank} exited")
            reply: messages.Probed = pickle.loads(conn.recv_bytes())
            found = reply.found and found
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
        """Stops rank 0's helpers, then the workers (they flush their disk writes; killed after
        STOP_WAIT_S)."""
        self.driver.close()
        self._closing = True
        if self._disk_ops and self.failed is None:
            with contextlib.suppress(Exception):
                self._send(None)  # the last disk ops alone
        self._finalizer()
