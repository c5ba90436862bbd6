"""A tensor-parallel worker process (ranks 1..N-1): loads its shard, allocates its own paged KV
cache (its KV heads, the core's block ids) and CPU tier, and runs each step rank 0 sends it.

Started by the engine core (engine/worker/parallel/executor.py) as
`python -m engine.worker.parallel.worker FD`, FD one end of a socket pair; the first message is
its `WorkerSpec`. It exits when the core says stop, when the pipe closes (the core died), when
its parent changes, or when a step fails (a collective whose peer died): never waits forever.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from engine.config import EngineConfig
from engine.kv.plan import KVPlan
from engine.kv_io.offload import KVOffload, TPShare, open_disk
from engine.worker.attention import AttentionBackend, get_attention_backend
from engine.worker.attention.kv_quant import FP8_DTYPE, KVScales
from engine.worker.kv_calibration import calibration_pass
from engine.worker.model_loader import kv_dims, load_model
from engine.worker.models.base import CausalLM
from engine.worker.parallel.group import init_group
from engine.worker.parallel.step import StepMessage

log = logging.getLogger("deja.tp_worker")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    config: EngineConfig
    """The engine's config, dtype resolved."""
    rank: int
    world: int
    store_path: str
    """The FileStore the group meets in."""
    device: str
    """cpu, or cuda (this rank's device is cuda:rank)."""
    num_threads: int
    parent_pid: int


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def run_worker(conn: Connection) -> int:
    spec: WorkerSpec = pickle.loads(conn.recv_bytes())
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s %(name)s[rank {spec.rank}]: %(message)s",
        stream=sys.stderr,
    )
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(spec.rank)
        device = torch.device("cuda", spec.rank)
    cfg = spec.config
    try:
        group = init_group(spec.rank, spec.world, spec.store_path, device)
        backend = get_attention_backend(cfg.attention_backend, device)
        model, hf_config = load_model(cfg.model, device, backend, group)
        num_layers, num_kv_heads, head_dim = kv_dims(hf_config)
        first_kv, rank_kv = group.kv_heads(num_kv_heads)
        layer = (cfg.cache.block_size, rank_kv, head_dim)
        msg = pickle.loads(conn.recv_bytes())
        if msg[0] == "calibrate":  # fp8: join rank 0's pass (its maximum over the ranks)
            calibration_pass(model, backend, msg[1], (num_layers, *layer))
            msg = pickle.loads(conn.recv_bytes())
        if msg[0] != "alloc":
            return 0
        scales = None if msg[4] is None else KVScales.from_json(msg[4], source="rank 0")
        dtype = model.dtype if scales is None else FP8_DTYPE
        kv_cache = torch.zeros((num_layers, 2, msg[1], *layer), dtype=dtype, device=device)
        backend.bind_kv_cache(kv_cache, scales)
        offload = None
        if msg[2]:
            shape = (num_layers, 2, msg[2], *layer)
            cpu = torch.zeros(shape, dtype=dtype, pin_memory=kv_cache.is_cuda)
            disk = None
            if msg[3] is not None:  # rank 0's manifest: this rank's folder and share
                share = TPShare(spec.rank, spec.world, first_kv, rank_kv)
                block_bytes = cpu[:, :, 0].numel() * cpu.element_size()
                disk = open_disk(cfg.cache, msg[3], block_bytes, share)
            offload = KVOffload(cpu, disk)
    except BaseException as e:
        log.exception("tensor-parallel worker failed to start")
        conn.send_bytes(pickle.dumps(("failed", f"rank {spec.rank}: {type(e).__name__}: {e}")))
        return 1
    conn.send_bytes(pickle.dumps(("ready",)))
    try:
        _serve(conn, model, kv_cache, offload, backend, device)
    finally:
        if offload is not None:
            offload.close()  # the disk tier's queued writes reach disk
    return 0


def _serve(
    conn: Connection,
    model: CausalLM,
    kv_cache: torch.Tensor,
    offload: KVOffload | None,
    backend: AttentionBackend,
    device: torch.device,
) -> None:
    with torch.inference_mode():
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                log.warning("the engine core is gone; tensor-parallel worker exiting")
                return
            if msg[0] == "disk":  # rank 0's writes and deletes since the last message
                if offload is not None:
                    offload.repeat_disk_ops(msg[1], kv_cache)
                continue
            if msg[0] == "probe":
                disk = None if offload is None else offload.disk
                found = disk is not None and disk.probe(msg[1])
                conn.send_bytes(pickle.dumps(("probe", found)))
                continue
            if msg[0] == "disk-only":
                continue
            if msg[0] != "step":
                return
            step: StepMessage = msg[1]
            _apply_plan(step.plan, kv_cache, offload, backend)
            if offload is not None and offload.disk is not None:
                offload.disk.end_step()
            if step.batch is None:
                continue
            input_ids, positions, meta = step.batch.to(device)
            backend.prepare(meta)
            hidden = model(input_ids, positions, kv_cache, meta)  # [T, hidden]
            if step.logit_rows:
                idx = torch.tensor(step.logit_rows, dtype=torch.int64, device=device)
                model.compute_logits(hidden.index_select(0, idx))  # joins the gather


def _apply_plan(
    plan: KVPlan, kv_cache: torch.Tensor, offload: KVOffload | None, backend: AttentionBackend
) -> None:
    """The plan's CPU-tier copies and copy-on-write, on this rank's share of each block."""
    if offload is not None and (plan.spill or plan.swap_in or plan.disk_store or plan.disk_load):
        offload.apply(plan, kv_cache)
    if plan.cow:
        src = torch.tensor([s for s, _ in plan.cow], dtype=torch.long, device=kv_cache.device)
        dst = torch.tensor([d for _, d in plan.cow], dtype=torch.long, device=kv_cache.device)
        backend.copy_blocks(kv_cache, src, dst)


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
