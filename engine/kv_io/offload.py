"""The torch side of the lower tiers: the CPU cache tensor and plan execution (the tiers are
built by engine/kv_io/tier_setup.py).

CPU tier: `cpu_cache` [num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim], the
same per-block layout as the device cache, in pinned memory when the device is CUDA. The disk
tier's files live in engine/kv_io/disk.py.

Between steps (`after_step`) the offload carries out the write policy's disk writes: each block is
copied into its own staging payload (on CUDA: a device gather, then one non-blocking copy into
pinned host memory whose event the writer thread waits on), queued for the writer thread, and the
step goes on; it also hands the disk index the files a shared-budget scan deleted, and moves the
payloads warm start has read so far into free CPU blocks.

Tensor parallelism (N > 1): each rank keeps its own share of every block (its KV heads) in its
own folder, `<disk_dir>/tp<N>-rank<r>`, whose manifest names N, the rank and its heads, so a
restart with the same N finds its files and another N (including N = 1, at `<disk_dir>` itself)
is a clean miss. Rank 0 decides everything, as for the other tiers: it records the writes it
queued between steps and its deletes (`disk_ops`), which the workers repeat on their shares
before the next message, and a block is a disk hit only when every rank verified its own file
(engine/kv_io/disk.py's `peers_probe`): a rank whose write was refused or failed, or whose file
a budget scan removed, turns the block into a miss instead of a wrong load. The remote tier
(engine/kv_io/remote.py) works the same way: each rank writes its share under its own layout tag
(the manifest with its share), repeating rank 0's writes (`disk_ops`); rank 0's lookup reads and
checks every rank's share of a block (a hit needs all of them) and sends the others' with the
step that loads it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from cuda.tier_copy import copy_blocks_between
from engine.kv.disk_index import DiskIndex
from engine.kv.hashing import BlockHash
from engine.kv.plan import KVPlan
from engine.kv.tiers import TieredCache
from engine.kv.write_queue import DiskWrites
from engine.kv_io.disk import DiskFiles
from engine.stats import BufferStats

if TYPE_CHECKING:  # the remote tier's client needs redis, imported only when it is used
    from engine.kv_io.remote import RemoteKV


def kv_cache_direct_copies_available() -> bool:
    """Whether CuPy (for cudaMemcpy2DAsync) can be imported; the tiers then skip staging."""
    return importlib.util.find_spec("cupy") is not None


def _pairs(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
    return a, b


@dataclass(eq=False, repr=False)
class KVOffload:
    """Carries out the CPU and disk parts of a KVPlan, in the plan's order (the runner's offload).

    On CUDA the copies run on a side stream: the stream first waits for the compute stream (the
    device blocks hold what earlier kernels wrote), and the compute stream waits for the copies
    before the forward (spills have left a block before it is overwritten; swap-ins and loads
    have arrived before a kernel reads them). Spills also wait on the host, because they land in
    the CPU tensor through a host-side scatter.
    """

    cpu_cache: torch.Tensor
    """[num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim]"""
    disk: DiskFiles | None = None
    disk_index: DiskIndex | None = None
    block_shape: tuple[int, ...] = field(init=False)
    """cpu_cache's shape without the block axis: (num_layers, 2, block_size, Hkv, D)."""
    _stream: Any = field(default=None, init=False)
    _inflight: list[torch.Tensor] = field(default_factory=list, init=False)
    """Host staging tensors of the last CUDA copies (kept alive until they are done)."""
    disk_manifest: dict[str, Any] | None = None
    """The disk folder's manifest without the tensor-parallel share (workers add theirs)."""
    disk_ops: list[DiskOp] | None = None
    """Tensor-parallel rank 0: the disk writes queued between steps and the deletes, in order,
    for the workers to repeat on their shares (None: not recorded)."""
    remote: RemoteKV | None = None
    """The remote tier's store (None: no remote tier)."""
    remote_manifest: dict[str, Any] | None = None
    """The manifest the remote tags are made of, without the tensor-parallel share (workers
    add theirs)."""
    direct_copies: bool = field(default_factory=kv_cache_direct_copies_available, init=False)
    """CUDA: spills and swap-ins move blocks straight between the pinned CPU tier and the
    device (cuda/tier_copy.py, CuPy); False: gather, staging tensor, scatter (torch only)."""

    def __post_init__(self) -> None:
        L, two, _, bs, h, d = self.cpu_cache.shape
        self.block_shape = (L, two, bs, h, d)

    def apply(self, plan: KVPlan, kv_cache: torch.Tensor) -> None:
        if kv_cache.is_cuda:
            self._apply_cuda(plan, kv_cache)
            return
        self._store_to_disk(plan)
        if plan.spill:
            dev, cpu = _pairs(plan.spill, kv_cache.device)
            self.cpu_cache[:, :, cpu] = kv_cache[:, :, dev]
        if plan.disk_load:
            # NOTE: one copy per block straight into the cache; torch.stack of the payloads then
            # an indexed store was ~7x slower (the stack along dim 2 of a 6-d tensor).
            assert self.disk is not None
            dtype = self.cpu_cache.dtype
            for h, d in plan.disk_load:
                kv_cache[:, :, d].copy_(self.disk.buffered(h).view(dtype).view(self.block_shape))
        if plan.remote_load:
            assert self.remote is not None
            dtype = self.cpu_cache.dtype
            for h, d in plan.remote_load:
                payload = self.remote.buffered(h)
                kv_cache[:, :, d].copy_(payload.view(dtype).view(self.block_shape))
        if plan.swap_in:
            cpu, dev = _pairs(plan.swap_in, kv_cache.device)
            kv_cache[:, :, dev] = self.cpu_cache[:, :, cpu]

    def buffers(self) -> list[BufferStats]:
        """The CPU tier's tensor and the disk tier's read cache and write queue."""
        n = self.cpu_cache.shape[2]
        nbytes = self.cpu_cache.nbytes
        out = [BufferStats("cpu_tier", n, nbytes, n, nbytes)]
        if self.disk is not None:
            out += self.disk.buffers()
        if self.remote is not None:
            r, p = self.remote, self.remote.payload_bytes
            out.append(
                BufferStats(
                    "remote_buffer",
                    r.num_buffered,
                    r.num_buffered * p,
                    r.buffer_blocks,
                    r.buffer_blocks * p,
                )
            )
            out.append(
                BufferStats(
                    "remote_write_queue", r.queued, r.queued * p, r.max_queued, r.max_queued * p
                )
            )
        return out

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits for queued disk and remote writes (tests, benchmarks, shutdown); True when all
        are done."""
        done = self.disk.flush(timeout_s) if self.disk is not None else True
        return (self.remote.flush(timeout_s) if self.remote is not None else True) and done

    def close(self, timeout_s: float | None = None) -> bool:
        """Flushes queued writes (bounded by `timeout_s`) and stops the disk and remote threads."""
        done = self.disk.close(timeout_s) if self.disk is not None else True
        return (self.remote.close(timeout_s) if self.remote is not None else True) and done

    # -- between steps -------------------------------------------------------------------------
    def after_step(
        self,
        tiers: TieredCache,
        kv_cache: torch.Tensor,
        device_lookup: Callable[[BlockHash], int | None],
    ) -> None:
        """The write policy's writes, budget-scan deletions and warm-start blocks (step thread,
        no plan pending)."""
        if self.remote is not None:
            writes = tiers.take_remote_writes(self.remote.room(), device_lookup)
            if writes:
                refused = self._stage(writes, kv_cache, self.remote.store)
                for h in refused:
                    assert tiers.remote is not None
                    tiers.remote.forget_write(h)
                if self.disk_ops is not None:  # the workers write their shares too
                    gone = set(refused)
                    self.disk_ops += [
                        ("rdev", b, h) for b, h in writes.from_device if h not in gone
                    ]
                    self.disk_ops += [("rcpu", c, h) for c, h in writes.from_cpu if h not in gone]
        disk, index = self.disk, self.disk_index
        if disk is None or index is None:
            return
        for h in disk.take_budget_deletes():
            index.remove(h)
        if disk.warming:
            self._insert_warm(tiers)
        writes = tiers.take_writes(disk.room(), device_lookup)
        if writes:
            refused = self._stage(writes, kv_cache, disk.store)
            for h in refused:
                tiers.forget_write(h)
            if self.disk_ops is not None:
                gone = set(refused)
                self.disk_ops += [("dev", b, h) for b, h in writes.from_device if h not in gone]
                self.disk_ops += [("cpu", c, h) for c, h in writes.from_cpu if h not in gone]
        self._delete(index.take_deletes())

    def _delete(self, hashes: list[BlockHash]) -> None:
        assert self.disk is not None
        for h in hashes:
            self.disk.delete(h)
        if self.disk_ops is not None:
            self.disk_ops += [("del", 0, h) for h in hashes]

    def repeat_disk_ops(self, ops: list[DiskOp], kv_cache: torch.Tensor) -> None:
        """A tensor-parallel worker: rank 0's disk and remote writes and its disk deletes, on
        this rank's share."""
        writes, remote = DiskWrites(), DiskWrites()
        for kind, block, h in ops:
            if kind == "del":
                if self.disk is not None:
                    self.disk.delete(h)
            elif kind in ("dev", "rdev"):
                (writes if kind == "dev" else remote).from_device.append((block, h))
            else:
                (writes if kind == "cpu" else remote).from_cpu.append((block, h))
        if writes and self.disk is not None:
            self._stage(writes, kv_cache, self.disk.store)
        if remote and self.remote is not None:
            self._stage(remote, kv_cache, self.remote.store)

    def _stage(
        self,
        writes: DiskWrites,
        kv_cache: torch.Tensor,
        store: Callable[[BlockHash, torch.Tensor, Any], bool],
    ) -> list[BlockHash]:
        """Copies the blocks into staging payloads and queues them with `store` (the disk's or
        the remote tier's); returns the hashes it refused."""
        dtype = self.cpu_cache.dtype
        refused: list[BlockHash] = []
        jobs: list[tuple[BlockHash, torch.Tensor, Any]] = []
        if writes.from_device:
            ids = [b for b, _ in writes.from_device]
            if kv_cache.is_cuda:
                # NOTE: from pinned memory, non-blocking: torch.tensor(ids, device=cuda) would
                # wait for the stream, i.e. for a step left in flight (async scheduling)
                idx = torch.tensor(ids, dtype=torch.long, pin_memory=True)
                idx = idx.to(kv_cache.device, non_blocking=True)
                # [n, num_layers, 2, block_size, Hkv, D] on the device, then one copy to the host
                gathered = kv_cache[:, :, idx].permute(2, 0, 1, 3, 4, 5).contiguous()
                host = torch.empty(gathered.shape, dtype=dtype, pin_memory=True)
                host.copy_(gathered, non_blocking=True)
                ready: Any = torch.cuda.Event()
                ready.record()
                jobs += [(h, host[i], ready) for i, (_, h) in enumerate(writes.from_device)]
            else:
                stage = torch.empty((len(ids), *self.block_shape), dtype=dtype)
                for i, b in enumerate(ids):
                    stage[i].copy_(kv_cache[:, :, b])
                jobs += [(h, stage[i], None) for i, (_, h) in enumerate(writes.from_device)]
        for cpu_id, h in writes.from_cpu:
            snap = torch.empty(self.block_shape, dtype=dtype)
            snap.copy_(self.cpu_cache[:, :, cpu_id])
            jobs.append((h, snap, None))
        for h, payload, ready in jobs:
            if not store(h, payload.view(-1).view(torch.uint8), ready):
                refused.append(h)
        return refused

    def _insert_warm(self, tiers: TieredCache) -> None:
        assert self.disk is not None
        dtype = self.cpu_cache.dtype
        if self._stream is not None:
            self._stream.synchronize()  # no swap-in still reads a CPU block written here
        for h, payload in self.disk.take_warm():
            cpu_id = tiers.warm_target(h)
            if cpu_id is not None:
                self.cpu_cache[:, :, cpu_id] = payload.view(dtype).view(self.block_shape)

    def _store_to_disk(self, plan: KVPlan) -> None:
        """Step 1 of the plan: snapshot CPU blocks about to be reused, queue their files."""
        if self.disk is None:
            return
        for cpu_id, block_hash in plan.disk_store:
            snap = torch.empty(self.block_shape, dtype=self.cpu_cache.dtype)
            snap.copy_(self.cpu_cache[:, :, cpu_id])
            self.disk.store(block_hash, snap.view(-1).view(torch.uint8))
        if self.disk_index is not None:
            self._delete(self.disk_index.take_deletes())

    def _loaded_payloads(self, plan: KVPlan) -> torch.Tensor:
        """[num_layers, 2, n, block_size, Hkv, D] host tensor of the plan's disk loads, then its
        remote loads."""
        dtype = self.cpu_cache.dtype
        L, two, bs, h, d = self.block_shape
        payloads = [self.disk.buffered(k) for k, _ in plan.disk_load] if self.disk else []
        payloads += [self.remote.buffered(k) for k, _ in plan.remote_load] if self.remote else []
        out = torch.empty((L, two, len(payloads), bs, h, d), dtype=dtype)
        for i, payload in enumerate(payloads):
            out[:, :, i].copy_(payload.view(dtype).view(self.block_shape))
        return out

    def _apply_cuda(self, plan: KVPlan, kv_cache: torch.Tensor) -> None:
        device = kv_cache.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream
        compute = torch.cuda.current_stream(device)
        # NOTE: host reads of CPU blocks (disk snapshots) need the last step's copies done.
        stream.synchronize()
        self._inflight.clear()
        self._store_to_disk(plan)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            direct = self.direct_copies and self.cpu_cache.is_pinned()
            if plan.spill and direct:
                copy_blocks_between(self.cpu_cache, kv_cache, plan.spill, stream)
                stream.synchronize()  # spilled blocks are host-readable when apply returns
            elif plan.spill:
                dev, cpu = _pairs(plan.spill, device)
                staged = kv_cache[:, :, dev]  # gather on the copy stream
                host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
                host.copy_(staged, non_blocking=True)
                stream.synchronize()
                self.cpu_cache[:, :, cpu.cpu()] = host
            srcs: list[torch.Tensor] = []
            dsts: list[int] = []
            if plan.disk_load or plan.remote_load:
                srcs.append(self._loaded_payloads(plan))
                dsts += [d for _, d in plan.disk_load] + [d for _, d in plan.remote_load]
            if plan.swap_in and direct:
                # Straight from the pinned CPU tier; the next apply's synchronize keeps the
                # source blocks from being reused before the copies are done.
                copy_blocks_between(kv_cache, self.cpu_cache, plan.swap_in, stream)
            elif plan.swap_in:
                cpu_ids = torch.tensor([c for c, _ in plan.swap_in], dtype=torch.long)
                srcs.append(self.cpu_cache[:, :, cpu_ids])
                dsts += [d for _, d in plan.swap_in]
            if srcs:
                host = torch.cat(srcs, dim=2).pin_memory()
                dst = torch.tensor(dsts, dtype=torch.long).to(device, non_blocking=True)
                kv_cache[:, :, dst] = host.to(device, non_blocking=True)
                self._inflight.append(host)
            done = stream.record_event()
        compute.wait_event(done)


DiskOp = tuple[str, int, BlockHash]
"""("dev", device block, hash) | ("cpu", CPU block, hash): a disk write queued from that block;
("rdev", ...) | ("rcpu", ...): the same for the remote tier; ("del", 0, hash): a disk delete."""
