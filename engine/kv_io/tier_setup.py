"""Building one engine's lower tiers: the manifests that name a KV layout, each rank's share of
it, and the CPU, disk and remote tiers of one engine (`build_tiers`), carried out by
engine/kv_io/offload.py's KVOffload."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import CacheConfig
from engine.kv.disk_index import DiskIndex
from engine.kv.events import KVEventBuffer
from engine.kv.tiers import TieredCache
from engine.kv_io.disk import DiskFiles
from engine.kv_io.disk_format import FORMAT, HEADER_BYTES, manifest_tag, read_manifest
from engine.kv_io.offload import KVOffload
from engine.kv_io.remote_format import FORMAT as REMOTE_FORMAT
from engine.stats import ModelInfo

if TYPE_CHECKING:  # needs redis, imported only when a remote tier is opened
    from engine.kv_io.remote import RemoteKV

KVScalesJSON = dict[str, list[float]]
"""Per-layer K and V scales of an fp8 cache, as the manifest holds them: {"k": [..], "v": [..]}."""


def disk_manifest(
    info: ModelInfo,
    model_fingerprint: str | None,
    kv_dtype: torch.dtype,
    kv_scales: KVScalesJSON | None,
) -> dict[str, Any]:
    """The disk tier's manifest: model, KV layout and KV encoding (dtype; fp8: the scales)."""
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "model_id": info.model_id,
        "model_fingerprint": model_fingerprint,
        "dtype": info.dtype,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "block_size": info.block_size,
        "layout": "[num_layers, 2, block_size, num_kv_heads, head_dim]",
        "num_layers": info.num_layers,
        "num_kv_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
    }
    if kv_scales is not None:
        manifest["kv_scales"] = kv_scales
    return manifest


def stored_kv_scales(disk_dir: str | Path, manifest: dict[str, Any]) -> KVScalesJSON | None:
    """The scales in `disk_dir`'s manifest when it is `manifest` but for them (same format,
    model, layout and KV dtype), else None: an fp8 engine restarted on its disk tier adopts the
    scales its blocks were written with instead of calibrating new ones."""
    found = read_manifest(Path(disk_dir).expanduser())
    if found is None or "kv_scales" not in found:
        return None
    scales = found.pop("kv_scales")
    mine = {k: v for k, v in manifest.items() if k != "kv_scales"}
    return scales if found == mine and isinstance(scales, dict) else None


@dataclass(frozen=True, slots=True)
class TPShare:
    """Which share of every block this rank's tiers hold (tensor parallelism)."""

    rank: int
    world: int
    first_kv_head: int
    kv_heads: int


def rank_disk(
    disk_dir: str, manifest: dict[str, Any], tp: TPShare | None
) -> tuple[Path, dict[str, Any]]:
    """(folder, manifest) of this rank's disk files: `disk_dir` itself at N = 1, else
    `<disk_dir>/tp<N>-rank<r>` with N, the rank and its KV heads in the manifest."""
    directory = Path(disk_dir).expanduser()
    if tp is None:
        return directory, manifest
    share = {"size": tp.world, "rank": tp.rank, "kv_heads": [tp.first_kv_head, tp.kv_heads]}
    return directory / f"tp{tp.world}-rank{tp.rank}", {**manifest, "tensor_parallel": share}


def open_disk(
    cache: CacheConfig, manifest: dict[str, Any], block_bytes: int, tp: TPShare | None
) -> DiskFiles | None:
    """This rank's disk files (`<disk_dir>/tp<N>-rank<r>` with N > 1), or None (logged) when
    the folder belongs to another model or layout. The budget `disk_gib` is shared by the N
    ranks' folders (each gets its 1 / N in blocks of rank 0's, the largest, share)."""
    assert cache.disk_dir
    directory, manifest = rank_disk(cache.disk_dir, manifest, tp)
    world = 1 if tp is None else tp.world
    capacity = int(cache.disk_gib * 2**30) // (world * (HEADER_BYTES + block_bytes))
    if capacity < 1:
        raise ValueError(f"disk_gib {cache.disk_gib} cannot hold one block of {block_bytes} bytes")
    return DiskFiles.open(
        directory,
        manifest,
        block_bytes,
        int(cache.disk_read_cache_mib * 2**20),
        max_queued=cache.disk_write_queue_blocks,
        write_queue_bytes=int(cache.disk_write_queue_mib * 2**20),
        capacity_blocks=capacity,
    )


def build_tiers(
    cache: CacheConfig,
    info: ModelInfo,
    model_fingerprint: str | None,
    kv_cache: torch.Tensor,
    block_bytes: int,
    *,
    kv_scales: KVScalesJSON | None = None,
    events: KVEventBuffer | None = None,
    tp: TPShare | None = None,
) -> tuple[TieredCache, KVOffload] | None:
    """The CPU tier (and the disk tier when `disk_dir` is set) of one engine, or None when off.

    Both hold blocks in kv_cache's dtype (fp8 blocks stay fp8, `block_bytes` is theirs); the
    disk manifest records the dtype and `kv_scales`, so the files are read back only under the
    same encoding. `model_fingerprint` (worker/model_loader.py) goes into the disk tier's
    manifest; it is read only when `disk_dir` is set. The tiers are off with prefix caching off
    (nothing would find their blocks) or a CPU tier of 0 blocks; the disk tier is filled from
    CPU-tier evictions, so it needs the CPU tier. `tp`: rank 0's share with N > 1 (its own
    disk folder; no warm start: the workers' CPU tiers would not hold the blocks).
    """
    if cache.num_cpu_blocks is not None:
        num_cpu = cache.num_cpu_blocks
    else:
        num_cpu = int(cache.cpu_swap_gib * 2**30) // block_bytes
    if num_cpu == 0:
        if cache.disk_dir or cache.kv_remote:
            raise ValueError(
                "the disk tier and the remote tier sit below the CPU tier: give cpu_swap_gib > 0 "
                "(or num_cpu_blocks > 0) together with disk_dir or kv_remote"
            )
        return None
    if not cache.enable_prefix_caching:
        return None
    L, two, _, bs, h, d = kv_cache.shape
    # NOTE: zeros, not empty: every page is touched now, so the tier's RSS is paid at start and
    # not as blocks get used for the first time (which looked like a leak in soak runs).
    # Pinned memory (CUDA) is resident from the start either way.
    cpu_cache = torch.zeros(
        (L, two, num_cpu, bs, h, d), dtype=kv_cache.dtype, pin_memory=kv_cache.is_cuda
    )
    manifest = disk_manifest(info, model_fingerprint, kv_cache.dtype, kv_scales)
    files, index = _disk_tier(cache, manifest, block_bytes, tp, num_cpu)
    remote = open_remote(cache, manifest, block_bytes, tp) if cache.kv_remote else None
    tiers = TieredCache(
        num_cpu,
        bs,
        disk=index,
        disk_io=files,
        max_pinned_fraction=cache.max_pinned_fraction,
        write_policy=cache.disk_write_policy,
        min_hits=cache.disk_write_min_hits,
        events=events,
        remote=remote,
        remote_write_policy=cache.kv_remote_write_policy,
    )
    offload = KVOffload(
        cpu_cache,
        files,
        index,
        disk_manifest=manifest if files is not None else None,
        disk_ops=[] if tp is not None and (files is not None or remote is not None) else None,
        remote=remote,
        remote_manifest=manifest if remote is not None else None,
    )
    return tiers, offload


def _disk_tier(
    cache: CacheConfig, manifest: dict[str, Any], block_bytes: int, tp: TPShare | None, num_cpu: int
) -> tuple[DiskFiles | None, DiskIndex | None]:
    """This rank's disk files and their index rebuilt from the folder (warm start begun), or
    (None, None) without a disk tier or when the folder belongs to another layout."""
    if not cache.disk_dir:
        return None, None
    files = open_disk(cache, manifest, block_bytes, tp)
    if files is None:
        return None, None
    assert files.capacity_blocks is not None
    index = DiskIndex(files.capacity_blocks)
    for block_hash in files.scan():
        index.add(block_hash)
    for block_hash in index.take_deletes():
        files.delete(block_hash)
    # most recently used first, so the hottest blocks arrive first
    n_warm = min(cache.warm_start_blocks if tp is None else 0, num_cpu, len(index))
    files.start_warm(list(reversed(index.entries))[:n_warm])
    return files, index


def remote_tag(manifest: dict[str, Any], tp: TPShare | None) -> bytes:
    """The layout tag of this rank's remote values: the disk manifest (model, fingerprint, KV
    dtype and scales, layout) with the remote format and the tensor-parallel share."""
    manifest = {**manifest, "format": REMOTE_FORMAT}
    if tp is not None:
        share = {"size": tp.world, "rank": tp.rank, "kv_heads": [tp.first_kv_head, tp.kv_heads]}
        manifest["tensor_parallel"] = share
    return manifest_tag(manifest)


def open_remote(
    cache: CacheConfig, manifest: dict[str, Any], block_bytes: int, tp: TPShare | None
) -> RemoteKV:
    """This rank's client of the remote tier (`kv_remote`); nothing is sent until it is used."""
    from engine.kv_io.remote import RemoteKV

    assert cache.kv_remote
    return RemoteKV(
        cache.kv_remote,
        remote_tag(manifest, tp),
        block_bytes,
        key_prefix=cache.kv_remote_key_prefix,
        ttl_s=cache.kv_remote_ttl_s,
        timeout_s=cache.kv_remote_timeout_s,
        retry_s=cache.kv_remote_retry_s,
        max_queued=cache.kv_remote_write_queue_blocks,
        buffer_blocks=int(cache.kv_remote_buffer_mib * 2**20) // block_bytes,
    )
