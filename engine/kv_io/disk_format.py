"""The disk tier's on-disk format: the manifest that binds a directory, and the block file.

`manifest.json` binds the directory to the model identity, dtype, block size and layout (FORMAT);
a directory whose manifest differs is not used (logged).
A block file is a 128-byte header (magic, block hash, payload length, XXH3-128 digest of the
payload; zero padded so the payload stays aligned for any dtype) and the payload: the block's
bytes [num_layers, 2, block_size, num_kv_heads, head_dim] in the cache dtype, C order. It is
written into a temp file in the same folder and renamed into place (atomic), so replicas sharing
the directory only ever see whole files; where it lives is engine/kv_io/disk_dir.py's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import threading
from pathlib import Path
from typing import Any

import torch
import xxhash

from engine.kv.hashing import BlockHash

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "deja-kv-disk-v2"
_MAGIC = b"DEJAKV\x00\x02"
_HEADER = struct.Struct("<8s32sQ16s")
"""magic, block hash, payload bytes, XXH3-128 digest of the payload.
NOTE: XXH3 (~10 GB/s) rather than a cryptographic hash: it guards against torn and corrupt
files, not against an attacker who can write the directory; blake2b (~0.3 GB/s here) made
verification, not the read, the cost of a disk hit."""
HEADER_BYTES = 128


class BadBlockFile(Exception):
    """A block file that is there but wrong: truncated, corrupt or another block's."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def claim_directory(root: Path, manifest: dict[str, Any]) -> bool:
    """Whether `root` may hold this manifest's blocks: its manifest is this one, or it has none
    and no block files (then this one is written). False is logged."""
    path = root / MANIFEST
    if path.is_file():
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            found = {"unreadable": str(exc)}
        if found != manifest:
            keys = sorted(k for k in set(found) | set(manifest) if found.get(k) != manifest.get(k))
            log.warning(
                "disk tier off: %s was written for another model or KV layout (differs in %s); "
                "give this engine its own disk_dir",
                root,
                ", ".join(keys),
            )
            return False
        return True
    if any(root.glob("??/*.kv")):
        log.warning(
            "disk tier off: %s holds block files but no %s, so their model is unknown; "
            "give this engine an empty or its own disk_dir",
            root,
            MANIFEST,
        )
        return False
    tmp = root / f".{MANIFEST}.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return True


def _digest(data: Any) -> bytes:
    return xxhash.xxh3_128_digest(data)


def write_block_file(path: Path, block_hash: BlockHash, payload: torch.Tensor) -> None:
    """Writes the block's file (header, then the payload's bytes) through a temp file renamed
    into place; raises OSError (the temp file removed) when the directory fails."""
    data = payload.numpy().data  # memoryview of the contiguous bytes
    digest = _digest(data)
    header = _HEADER.pack(_MAGIC, block_hash, data.nbytes, digest).ljust(HEADER_BYTES, b"\0")
    path.parent.mkdir(exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read_block_file(path: str, block_hash: BlockHash, payload_bytes: int) -> torch.Tensor | None:
    """The block's verified payload ([payload_bytes] uint8, owned) from the file at `path`, or
    None when it cannot be read (missing, or an error, logged).

    Raises BadBlockFile when the file is truncated, corrupt (checksum) or for another block.
    """
    expected = HEADER_BYTES + payload_bytes
    # NOTE: uninitialized (a bytearray zero-fills every byte first); the payload is a view
    # into it at HEADER_BYTES (aligned for any dtype), so the bytes are read once, not copied.
    buf = torch.empty(expected, dtype=torch.uint8)
    view = buf.numpy().data  # memoryview of the bytes
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("disk tier: cannot read %s: %s", path, exc)
        return None
    try:
        size = os.fstat(fd).st_size
        n = 0
        if size == expected:
            while n < expected:
                k = os.readv(fd, [view[n:]])
                if k == 0:
                    break
                n += k
    except OSError as exc:
        log.warning("disk tier: cannot read %s: %s", path, exc)
        return None
    finally:
        os.close(fd)
    if size != expected or n != expected:
        raise BadBlockFile(f"size {size if size != expected else n}, expected {expected}")
    magic, stored_hash, length, digest = _HEADER.unpack_from(view)
    if magic != _MAGIC:
        raise BadBlockFile("bad magic")
    if stored_hash != block_hash:
        raise BadBlockFile("header names another block")
    if length != payload_bytes:
        raise BadBlockFile(f"payload length {length}")
    if _digest(view[HEADER_BYTES:]) != digest:
        raise BadBlockFile("checksum mismatch")
    return buf[HEADER_BYTES:]
