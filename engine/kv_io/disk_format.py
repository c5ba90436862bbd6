"""The disk tier's on-disk format: the manifest that binds a directory, and the block file.

`manifest.json` binds the directory to the model identity, dtype, block size and layout (FORMAT),
and to the KV encoding: the KV dtype and, for fp8, the per-layer K and V scales the blocks were
quantized with (a restarted replica adopts them, engine/kv_io/tier_setup.py's `stored_kv_scales`);
a directory whose manifest differs is not used (logged).
A block file is a 128-byte header (magic with the format version, block hash, payload length,
XXH3-128 digest of the payload, the manifest's tag; zero padded so the payload stays aligned for
any dtype) and the payload: the block's bytes [num_layers, 2, block_size, num_kv_heads, head_dim]
in the KV dtype, C order. A file of an older format (magic) or written under another manifest
(tag: another KV dtype, other scales, another model) is a miss, never read as this one's. It is
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
FORMAT = "deja-kv-disk-v3"
"""v3: the manifest names the KV dtype and its scales, block headers carry the manifest's tag."""
_MAGIC = b"DEJAKV\x00\x03"
_HEADER = struct.Struct("<8s32sQ16s16s")
"""magic, block hash, payload bytes, XXH3-128 digest of the payload, manifest tag.
NOTE: XXH3 (~10 GB/s) rather than a cryptographic hash: it guards against torn and corrupt
files, not against an attacker who can write the directory; blake2b (~0.3 GB/s here) made
verification, not the read, the cost of a disk hit."""
HEADER_BYTES = 128


class BadBlockFile(Exception):
    """A block file that is there but wrong: truncated, corrupt or another block's."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The directory's manifest, or None when it has none or it cannot be read."""
    try:
        found = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


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


def digest(data: Any) -> bytes:
    """XXH3-128 of the bytes (see _HEADER)."""
    return xxhash.xxh3_128_digest(data)


def manifest_tag(manifest: dict[str, Any]) -> bytes:
    """16 bytes naming a manifest (its canonical JSON's digest): every block file carries its
    writer's, so a file written under another KV dtype, other scales or another model never
    reads as this directory's."""
    return digest(json.dumps(manifest, sort_keys=True).encode())


NO_TAG = bytes(16)
"""The tag of files written without a manifest (tests of the file format alone)."""


def write_block_file(
    path: Path, block_hash: BlockHash, payload: torch.Tensor, tag: bytes = NO_TAG
) -> None:
    """Writes the block's file (header, then the payload's bytes) through a temp file renamed
    into place; raises OSError (the temp file removed) when the directory fails."""
    data = payload.numpy().data  # memoryview of the contiguous bytes
    checksum = digest(data)
    header = _HEADER.pack(_MAGIC, block_hash, data.nbytes, checksum, tag).ljust(HEADER_BYTES, b"\0")
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


def read_block_file(
    path: str, block_hash: BlockHash, payload_bytes: int, tag: bytes = NO_TAG
) -> torch.Tensor | None:
    """The block's verified payload ([payload_bytes] uint8, owned) from the file at `path`, or
    None when it cannot be read (missing, or an error, logged).

    Raises BadBlockFile when the file is truncated, corrupt (checksum), for another block, of
    an older format or written under another manifest (`tag`).
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
    magic, stored_hash, length, checksum, stored_tag = _HEADER.unpack_from(view)
    if magic != _MAGIC:
        old = magic[:6] == _MAGIC[:6]
        raise BadBlockFile("an older format's file" if old else "bad magic")
    if stored_tag != tag:
        raise BadBlockFile("written under another manifest (KV dtype, scales or model)")
    if stored_hash != block_hash:
        raise BadBlockFile("header names another block")
    if length != payload_bytes:
        raise BadBlockFile(f"payload length {length}")
    if digest(view[HEADER_BYTES:]) != checksum:
        raise BadBlockFile("checksum mismatch")
    return buf[HEADER_BYTES:]
