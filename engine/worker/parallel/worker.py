"""A tensor-parallel worker process (ranks 1..N-1): one `Worker` (engine/worker/worker.py), driven
by the typed messages rank 0 sends (engine/worker/parallel/messages.py).

Started by the multiprocess executor (engine/executor/multiproc.py) as
`python -m engine.worker.parallel.worker FD`, FD one end of a socket pair; the first message is
its `WorkerSpec`. It exits when rank 0 says Stop, when the pipe closes (the core died), when its
parent changes, or when a step fails (a collective whose peer died): it never waits forever.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.worker.parallel import messages
from engine.worker.parallel.group import init_group
from engine.worker.worker import Worker, rank_device

log = logging.getLogger("deja.tp_worker")


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _send(conn: Connection, msg: Any) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _start(conn: Connection, spec: messages.WorkerSpec) -> Worker | None:
    """Joins the group, loads the shard, joins a calibration pass if asked, allocates; None when
    rank 0 stopped before the allocation."""
    device = rank_device(spec.config.device, spec.rank)
    group = init_group(spec.rank, spec.world, spec.store_path, device)
    worker = Worker(spec.config, group)
    msg = _recv(conn)
    if isinstance(msg, messages.Calibrate):  # fp8: join rank 0's pass (its maximum over the ranks)
        worker.calibrate(msg.prompts)
        msg = _recv(conn)
    if not isinstance(msg, messages.Allocate):
        return None
    worker.allocate(msg)
    return worker


def run_worker(conn: Connection) -> int:
    spec: messages.WorkerSpec = _recv(conn)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s %(name)s[rank {spec.rank}]: %(message)s",
        stream=sys.stderr,
    )
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.num_threads)
    try:
        worker = _start(conn, spec)
    except BaseException as e:
        log.exception("tensor-parallel worker failed to start")
        _send(conn, messages.Failed(f"rank {spec.rank}: {type(e).__name__}: {e}"))
        return 1
    if worker is None:
        return 0
    remote = None if worker.offload is None else worker.offload.remote
    share = None if remote is None else (remote.tag, remote.payload_bytes)
    _send(conn, messages.Ready(share))
    try:
        _serve(conn, worker)
    finally:
        worker.close()  # the disk tier's queued writes reach disk
    return 0


def _serve(conn: Connection, worker: Worker) -> None:
    while True:
        try:
            msg = _recv(conn)
        except (EOFError, OSError):
            log.warning("the engine core is gone; tensor-parallel worker exiting")
            return
        if isinstance(msg, messages.Step):
            worker.run_step(msg)
        elif isinstance(
            msg, messages.DiskOps
        ):  # rank 0's writes and deletes since the last message
            if worker.offload is not None and worker.kv_cache is not None:
                worker.offload.repeat_disk_ops(msg.ops, worker.kv_cache)
        elif isinstance(msg, messages.Probe):
            disk = None if worker.offload is None else worker.offload.disk
            _send(conn, messages.Probed(disk is not None and disk.probe(msg.block_hash)))
        elif isinstance(msg, messages.Stop):
            return


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    try:
        code = run_worker(conn)
    except BaseException:
        log.exception("tensor-parallel worker failed")
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
