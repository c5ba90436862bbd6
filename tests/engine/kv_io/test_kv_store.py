"""The torch side of the tiers: plan execution on tensors, and the disk tier's files."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from engine.kv.disk_index import DiskIndex
from engine.kv.plan import KVPlan
from engine.kv_io.disk import DiskFiles
from engine.kv_io.disk_format import HEADER_BYTES, MANIFEST
from engine.kv_io.offload import KVOffload

L, BS, H, D = 2, 4, 2, 8
SHAPE = (L, 2, BS, H, D)
PAYLOAD = L * 2 * BS * H * D * 4  # float32
MANIFEST_A = {"format": "test", "model_id": "m", "dtype": "float32", "block_size": BS}


def h(i: int) -> bytes:
    return bytes([i]) * 32


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def payload(seed: int) -> torch.Tensor:
    return block(seed).reshape(-1).view(torch.uint8)


def open_files(root: Path, manifest: dict | None = None) -> DiskFiles:
    files = DiskFiles.open(root, manifest or MANIFEST_A, PAYLOAD)
    assert files is not None
    return files


def test_file_round_trip_and_restart_scan(tmp_path: Path) -> None:
    files = open_files(tmp_path)
    files.store(h(1), payload(1))
    assert files.probe(h(1))  # readable before the write lands
    files.flush()
    files.end_step()
    path = files.path(h(1))
    assert path.is_file() and path.stat().st_size == HEADER_BYTES + PAYLOAD
    assert path.parent.name == h(1).hex()[:2]
    files.close()
    again = open_files(tmp_path)  # a restart: same manifest, the file is found
    assert again.scan() == [h(1)]
    assert again.probe(h(1))
    assert torch.equal(again.buffered(h(1)), payload(1))
    assert not again.probe(h(2))
    again.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_block", "extend"])
def test_bad_file_is_deleted_and_a_miss(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    files = open_files(tmp_path)
    files.store(h(1), payload(1))
    files.store(h(2), payload(2))
    files.flush()
    files.end_step()
    path = files.path(h(1))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[HEADER_BYTES + 100] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "other_block":
        data = bytearray(files.path(h(2)).read_bytes())
    else:
        data += b"\0"
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="engine.kv_io.offload"):
        assert not files.probe(h(1))
    assert "bad block file" in caplog.text
    assert not path.exists() and files.num_bad == 1
    assert files.probe(h(2))
    files.close()


def test_manifest_mismatch_refuses_the_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    open_files(tmp_path).close()
    other = {**MANIFEST_A, "dtype": "bfloat16"}
    with caplog.at_level(logging.WARNING, logger="engine.kv_io.offload"):
        assert DiskFiles.open(tmp_path, other, PAYLOAD) is None
    assert "differs in dtype" in caplog.text
    (tmp_path / MANIFEST).write_text("{not json")
    assert DiskFiles.open(tmp_path, MANIFEST_A, PAYLOAD) is None


def test_block_files_without_manifest_are_refused(tmp_path: Path) -> None:
    files = open_files(tmp_path)
    files.store(h(1), payload(1))
    files.flush()
    files.close()
    (tmp_path / MANIFEST).unlink()
    assert DiskFiles.open(tmp_path, MANIFEST_A, PAYLOAD) is None


def test_scan_orders_by_access_time_and_cleans_up(tmp_path: Path) -> None:
    files = open_files(tmp_path)
    for i in (1, 2, 3):
        files.store(h(i), payload(i))
    files.flush()
    os.utime(files.path(h(1)), (3000, 3000))
    os.utime(files.path(h(2)), (1000, 1000))
    os.utime(files.path(h(3)), (2000, 2000))
    stale = files.path(h(4)).parent / ".stale.tmp"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"x")
    os.utime(stale, (1000, 1000))
    short = files.path(h(5))
    short.parent.mkdir(exist_ok=True)
    short.write_bytes(b"short")
    assert files.scan() == [h(2), h(3), h(1)]
    assert not stale.exists() and not short.exists()
    files.close()


def test_replicas_share_a_directory(tmp_path: Path) -> None:
    a, b = open_files(tmp_path), open_files(tmp_path)
    a.store(h(1), payload(1))
    b.store(h(1), payload(1))  # the same block from two replicas: one file
    a.flush()
    b.flush()
    a.end_step()
    b.end_step()
    assert b.probe(h(1)) and a.probe(h(1))
    a.end_step()
    b.end_step()
    a.delete(h(1))  # one replica evicts it; the other sees a clean miss
    a.flush()
    assert not b.probe(h(1)) and b.num_bad == 0
    a.close()
    b.close()


def make_store(tmp_path: Path, num_cpu: int = 4) -> tuple[KVOffload, torch.Tensor, DiskIndex]:
    cpu = torch.zeros((L, 2, num_cpu, BS, H, D))
    index = DiskIndex(16)
    return KVOffload(cpu, open_files(tmp_path), index), cpu, index


def test_apply_runs_the_plan_in_order(tmp_path: Path) -> None:
    store, cpu, index = make_store(tmp_path)
    assert store.disk is not None
    kv = torch.stack([block(100 + i) for i in range(6)], dim=2)  # 6 device blocks
    cpu[:, :, 0] = block(7)  # CPU block 0 holds h(7), about to be reused
    store.disk.store(h(9), payload(9))  # a disk hit verified earlier in the step
    index.add(h(3))
    plan = KVPlan(
        disk_store=[(0, h(7))],
        spill=[(2, 0), (3, 1)],
        disk_load=[(h(7), 4), (h(9), 5)],
        swap_in=[(1, 2)],
    )
    before = kv.clone()
    index.take_deletes()
    store.apply(plan, kv)
    # disk store first: the file holds CPU block 0's old bytes, not the spill's.
    assert torch.equal(cpu[:, :, 0], before[:, :, 2]) and torch.equal(cpu[:, :, 1], before[:, :, 3])
    assert torch.equal(kv[:, :, 4], block(7)), "the load read the snapshot, not the spilled block"
    assert torch.equal(kv[:, :, 5], block(9))
    assert torch.equal(kv[:, :, 2], before[:, :, 3]), "swap-in ran after the spill into its source"
    assert torch.equal(kv[:, :, 0], before[:, :, 0]) and torch.equal(kv[:, :, 3], before[:, :, 3])
    store.flush()
    store.disk.end_step()
    assert store.disk.probe(h(7)) and torch.equal(store.disk.buffered(h(7)), payload(7))
    store.close()


def test_apply_queues_index_evictions_as_deletes(tmp_path: Path) -> None:
    store, cpu, _ = make_store(tmp_path)
    index = DiskIndex(1)
    store.disk_index = index
    kv = torch.zeros((L, 2, 2, BS, H, D))
    cpu[:, :, 0] = block(1)
    index.add(h(1))
    store.apply(KVPlan(disk_store=[(0, h(1))]), kv)
    cpu[:, :, 1] = block(2)
    index.add(h(2))  # over the budget: h(1) goes
    store.apply(KVPlan(disk_store=[(1, h(2))]), kv)
    store.flush()
    assert store.disk is not None
    assert not store.disk.path(h(1)).exists() and store.disk.path(h(2)).exists()
    store.close()


def test_bfloat16_payload_round_trip(tmp_path: Path) -> None:
    files = DiskFiles.open(tmp_path, MANIFEST_A, PAYLOAD // 2)
    assert files is not None
    data = block(3).to(torch.bfloat16)
    files.store(h(1), data.reshape(-1).view(torch.uint8).clone())
    files.flush()
    files.end_step()
    assert files.probe(h(1))
    back = files.buffered(h(1)).view(torch.bfloat16).view(SHAPE)
    assert torch.equal(back, data)
    files.close()


def test_read_cache_keeps_verified_payloads_across_steps(tmp_path: Path) -> None:
    files = DiskFiles.open(tmp_path, MANIFEST_A, PAYLOAD, read_cache_bytes=2 * PAYLOAD)
    assert files is not None
    for i in (1, 2, 3):
        files.store(h(i), payload(i))
    files.flush()
    files.end_step()  # stored payloads are not cached: later hits read their files
    for i in (1, 2, 3):
        assert files.probe(h(i))
    files.end_step()  # keeps the 2 most recently read: h(2), h(3)
    for i in (1, 2, 3):
        files.path(h(i)).unlink()
    assert not files.probe(h(1))
    assert files.probe(h(2)) and files.probe(h(3))  # no file needed: verified bytes in memory
    assert torch.equal(files.buffered(h(2)), payload(2))
    files.close()
