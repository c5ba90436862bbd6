"""The disk tier's files: content-addressed, checksummed, shared safely between replicas.

One file per block: `<dir>/<hh>/<block hash hex>.kv` (hh = the first two hex digits). A file is a
128-byte header (magic, block hash, payload length, blake2b-128 of the payload; zero padded so the
payload stays aligned for any dtype) and the payload: the block's bytes
[num_layers, 2, block_size, num_kv_heads, head_dim] in the cache dtype, C order.
Files are written by one writer thread from snapshots of CPU blocks taken before the CPU block is
reused, into a temp file in the same folder and renamed into place (atomic), so replicas sharing
the directory only ever see whole files. `manifest.json` binds the directory to the model
identity, dtype, block size and layout; a directory whose manifest differs is not used (logged).
A file that is missing, truncated, corrupt (checksum) or for another block is deleted and is a
miss: it is detected when `find` probes it, before the manager plans a load (see engine/kv/tiers).
On startup the index is rebuilt from the directory, least recently accessed (mtime) first; a read
refreshes the file's mtime.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from engine.kv.hashing import BlockHash
from engine.model_loader import safetensors_files

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "deja-kv-disk-v1"
_MAGIC = b"DEJAKV\x00\x01"
_HEADER = struct.Struct("<8s32sQ16s")
"""magic, block hash, payload bytes, blake2b-128 digest of the payload."""
HEADER_BYTES = 128
_SUFFIX = ".kv"
READ_CACHE_BYTES = 128 * 2**20
"""Verified disk payloads an engine keeps in memory across steps."""
_STALE_TMP_S = 3600.0
"""Temp files older than this are leftovers of a crashed writer and are removed at startup."""


def model_fingerprint(model_path: str | Path) -> str:
    """blake2b over config.json and each weight file's name, size and first MiB (cheap, stable)."""
    folder = Path(model_path)
    h = hashlib.blake2b(digest_size=16)
    h.update((folder / "config.json").read_bytes())
    for f in safetensors_files(folder):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(2**20))
    return h.hexdigest()


class DiskFiles:
    """The disk tier's files: checksummed, written by a background thread, read on `probe`."""

    def __init__(
        self, directory: Path, payload_bytes: int, read_cache_bytes: int = READ_CACHE_BYTES
    ) -> None:
        self.directory = directory
        self.payload_bytes = payload_bytes
        self.read_cache_blocks = read_cache_bytes // payload_bytes
        """Verified payloads kept past the end of a step (least recently used dropped first)."""
        self.num_bad = 0
        """Files found corrupt, truncated or for another block (deleted)."""
        self._buffer: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()
        """Verified payloads ([payload_bytes] uint8) by hash: this step's, then a small cache.
        NOTE: a verified payload stays valid whatever later happens to its file (content
        addressed), and the cache spares a prompt waiting at the head of the queue from
        re-reading its disk hits every step."""
        self._stored: dict[BlockHash, torch.Tensor] = {}
        """Payloads stored in this step (a load later in the same step reads them here)."""
        self._pending: dict[BlockHash, torch.Tensor] = {}
        """Payloads queued for writing (readable before their file exists)."""
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, BlockHash, torch.Tensor | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="deja-disk-writer", daemon=True)
        self._thread.start()

    @classmethod
    def open(
        cls,
        directory: str | Path,
        manifest: dict[str, Any],
        payload_bytes: int,
        read_cache_bytes: int = 0,
    ) -> DiskFiles | None:
        """The directory's files, or None (logged) when it belongs to another model or layout."""
        root = Path(directory).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        path = root / MANIFEST
        if path.is_file():
            try:
                found = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                found = {"unreadable": str(exc)}
            if found != manifest:
                keys = sorted(
                    k for k in set(found) | set(manifest) if found.get(k) != manifest.get(k)
                )
                log.warning(
                    "disk tier off: %s was written for another model or KV layout (differs in %s); "
                    "give this engine its own disk_dir",
                    root,
                    ", ".join(keys),
                )
                return None
        else:
            if any(root.glob(f"??/*{_SUFFIX}")):
                log.warning(
                    "disk tier off: %s holds block files but no %s, so their model is unknown; "
                    "give this engine an empty or its own disk_dir",
                    root,
                    MANIFEST,
                )
                return None
            tmp = root / f".{MANIFEST}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
        return cls(root, payload_bytes, read_cache_bytes)

    def path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / (name + _SUFFIX)

    def scan(self) -> list[BlockHash]:
        """Hashes of the block files in the directory, least recently accessed first."""
        found: list[tuple[float, BlockHash]] = []
        now = time.time()
        for sub in self.directory.iterdir():
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            for f in sub.iterdir():
                try:
                    st = f.stat()
                except FileNotFoundError:  # another replica removed it
                    continue
                if f.name.endswith(".tmp"):
                    if now - st.st_mtime > _STALE_TMP_S:
                        _unlink(f)
                    continue
                if not f.name.endswith(_SUFFIX):
                    continue
                try:
                    h = bytes.fromhex(f.name[: -len(_SUFFIX)])
                except ValueError:
                    continue
                if len(h) != 32:
                    continue
                if st.st_size != HEADER_BYTES + self.payload_bytes:
                    self._drop_bad(f, f"size {st.st_size}")
                    continue
                found.append((st.st_mtime, h))
        found.sort()
        return [h for _, h in found]

    # -- DiskIO --------------------------------------------------------------------------------
    def probe(self, block_hash: BlockHash) -> bool:
        if block_hash in self._stored:
            return True
        if block_hash in self._buffer:
            self._buffer.move_to_end(block_hash)
            return True
        with self._lock:
            payload = self._pending.get(block_hash)
        if payload is None:
            payload = self._read(block_hash)
        if payload is None:
            return False
        self._buffer[block_hash] = payload
        return True

    def end_step(self) -> None:
        self._stored.clear()
        while len(self._buffer) > self.read_cache_blocks:
            self._buffer.popitem(last=False)

    def buffered(self, block_hash: BlockHash) -> torch.Tensor:
        """The payload that `probe` or `store` made available in this step."""
        payload = self._stored.get(block_hash)
        return payload if payload is not None else self._buffer[block_hash]

    # -- writes --------------------------------------------------------------------------------
    def store(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        """Queues a write; the payload ([payload_bytes] uint8, owned) is readable right away."""
        self._stored[block_hash] = payload
        with self._lock:
            self._pending[block_hash] = payload
        self._queue.put(("store", block_hash, payload))

    def delete(self, block_hash: BlockHash) -> None:
        self._queue.put(("delete", block_hash, None))

    def flush(self) -> None:
        """Waits until every queued write and delete is done."""
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                self._queue.task_done()
                return
            kind, block_hash, payload = op
            try:
                if kind == "store":
                    assert payload is not None
                    self._write(block_hash, payload)
                else:
                    _unlink(self.path(block_hash))
            except OSError as exc:
                log.warning(
                    "disk tier: %s of block %s failed: %s", kind, block_hash.hex()[:16], exc
                )
            finally:
                if payload is not None:
                    with self._lock:
                        if self._pending.get(block_hash) is payload:
                            del self._pending[block_hash]
                self._queue.task_done()

    def _write(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        data = payload.numpy().data  # memoryview of the contiguous bytes
        digest = hashlib.blake2b(data, digest_size=16).digest()
        header = _HEADER.pack(_MAGIC, block_hash, data.nbytes, digest).ljust(HEADER_BYTES, b"\0")
        path = self.path(block_hash)
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(data)
        os.replace(tmp, path)

    def _read(self, block_hash: BlockHash) -> torch.Tensor | None:
        path = self.path(block_hash)
        expected = HEADER_BYTES + self.payload_bytes
        buf = bytearray(expected + 1)  # one spare byte tells a longer file apart
        try:
            with open(path, "rb") as f:
                n = f.readinto(buf)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("disk tier: cannot read %s: %s", path, exc)
            return None
        reason = None
        if n != expected:
            reason = f"size {n}, expected {expected}"
        else:
            magic, stored_hash, length, digest = _HEADER.unpack_from(buf)
            payload = memoryview(buf)[HEADER_BYTES:expected]
            if magic != _MAGIC:
                reason = "bad magic"
            elif stored_hash != block_hash:
                reason = "header names another block"
            elif length != self.payload_bytes:
                reason = f"payload length {length}"
            elif hashlib.blake2b(payload, digest_size=16).digest() != digest:
                reason = "checksum mismatch"
        if reason is not None:
            self._drop_bad(path, reason)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # access time for the LRU order after a restart
        return torch.frombuffer(
            buf, dtype=torch.uint8, offset=HEADER_BYTES, count=self.payload_bytes
        )

    def _drop_bad(self, path: Path, reason: str) -> None:
        self.num_bad += 1
        log.warning("disk tier: deleting bad block file %s (%s); it is a cache miss", path, reason)
        _unlink(path)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
