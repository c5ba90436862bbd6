"""The disk tier's read path: coarse mtime refresh off the read path, warm start, bad sizes."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.kv_io.disk import DiskFiles
from engine.kv_io.disk_format import HEADER_BYTES

PAYLOAD = 4096
MANIFEST = {"format": "test"}


def h(i: int) -> bytes:
    return bytes([i]) * 32


def payload(seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (PAYLOAD,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def written(root: Path, n: int) -> DiskFiles:
    files = DiskFiles.open(root, MANIFEST, PAYLOAD)
    assert files is not None
    for i in range(n):
        files.store(h(i), payload(i))
    files.flush()
    files.end_step()
    return files


def test_read_refreshes_mtime_once_per_interval_on_the_writer(tmp_path: Path) -> None:
    files = written(tmp_path, 2)
    for i in (0, 1):
        os.utime(files.path(h(i)), (1000, 1000))
    got = files.read(h(0))
    assert got is not None and torch.equal(got, payload(0))
    assert files.path(h(0)).stat().st_mtime == 1000  # not on the read path
    files.end_step()
    files.flush()
    assert files.path(h(0)).stat().st_mtime > 1000
    assert files.path(h(1)).stat().st_mtime == 1000
    os.utime(files.path(h(0)), (2000, 2000))
    assert files.read(h(0)) is not None  # within TOUCH_EVERY_S of the last refresh
    files.end_step()
    files.flush()
    assert files.path(h(0)).stat().st_mtime == 2000
    assert files.scan() == [h(1), h(0)]
    files.close()


def test_read_rejects_wrong_sizes_and_missing_files(tmp_path: Path) -> None:
    files = written(tmp_path, 2)
    with open(files.path(h(0)), "ab") as f:
        f.write(b"\0")
    assert files.read(h(0)) is None and not files.path(h(0)).exists()
    path = files.path(h(1))
    path.write_bytes(path.read_bytes()[: HEADER_BYTES + 10])
    assert files.read(h(1)) is None and not path.exists()
    assert files.read(h(7)) is None
    assert files.num_bad == 2
    files.close()


def test_warm_start_reads_in_order_and_skips_missing(tmp_path: Path) -> None:
    files = written(tmp_path, 3)
    files.close()
    again = DiskFiles.open(tmp_path, MANIFEST, PAYLOAD)
    assert again is not None
    again.start_warm([h(2), h(9), h(0)])
    assert again.warming
    again.wait_warm(30)
    got = again.take_warm()
    assert [x for x, _ in got] == [h(2), h(0)]
    assert torch.equal(got[1][1], payload(0))
    assert not again.warming
    again.close()
