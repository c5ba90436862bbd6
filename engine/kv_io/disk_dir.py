"""The disk tier's directory: where block files live, the startup scan, the shared budget.

One file per block: `<dir>/<hh>/<block hash hex>.kv` (hh = the first two hex digits); writers
create `.<name>.<pid>.<thread>.tmp` beside it and rename it into place.

Shared directory: replicas on one host may share it. Files are whole (atomic rename) and content
addressed, so a file written by one is valid for all. The size budget is kept together by
`enforce_budget`: each replica's writer thread counts the directory's block files every
`scan_every` writes (and at close) and deletes the least recently accessed (oldest mtime; reads
refresh it, coarsely) beyond the budget, so the directory exceeds it by at most `scan_every` blocks
per replica between scans. A file another replica deleted is a clean miss (and leaves that
replica's index on its next lookup).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from engine.kv.hashing import BlockHash

SUFFIX = ".kv"
STALE_TMP_S = 3600.0
"""Temp files older than this are leftovers of a crashed writer and are removed by a scan."""


def block_path(directory: Path, block_hash: BlockHash) -> Path:
    name = block_hash.hex()
    return directory / name[:2] / (name + SUFFIX)


def scan(
    directory: Path, file_bytes: int, drop_bad: Callable[[Path, str], None]
) -> list[BlockHash]:
    """Hashes of the block files in `directory`, least recently accessed (mtime) first.

    Files of the wrong size go to `drop_bad`; stale temp files are removed.
    """
    found: list[tuple[float, BlockHash]] = []
    now = time.time()
    for sub in directory.iterdir():
        if len(sub.name) != 2 or not sub.is_dir():
            continue
        for f in sub.iterdir():
            try:
                st = f.stat()
            except FileNotFoundError:  # another replica removed it
                continue
            if f.name.endswith(".tmp"):
                if now - st.st_mtime > STALE_TMP_S:
                    unlink(f)
                continue
            if not f.name.endswith(SUFFIX):
                continue
            try:
                h = bytes.fromhex(f.name[: -len(SUFFIX)])
            except ValueError:
                continue
            if len(h) != 32:
                continue
            if st.st_size != file_bytes:
                drop_bad(f, f"size {st.st_size}")
                continue
            found.append((st.st_mtime, h))
    found.sort()
    return [h for _, h in found]


def enforce_budget(
    directory: Path,
    capacity_blocks: int,
    file_bytes: int,
    drop_bad: Callable[[Path, str], None],
) -> list[BlockHash]:
    """Deletes the least recently accessed block files beyond `capacity_blocks` (counting every
    replica's files in the directory); returns their hashes."""
    found = scan(directory, file_bytes, drop_bad)
    extra = found[: max(0, len(found) - capacity_blocks)]
    for h in extra:
        unlink(block_path(directory, h))
    return extra


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
