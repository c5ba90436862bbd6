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

The writer never holds up the step loop: `store` takes a payload already copied off the KV cache
(the step thread's staging copy) and returns at once; at most `max_queued` stores wait, and a store
past that is refused (the caller counts it as dropped). The first failed write (read-only or full
directory, any OSError) turns the tier off: a warning, `num_write_errors`, `enabled` False, queued
writes dropped, lookups stop (requests go on without the tier).

Shared directory: replicas on one host may share it. Files are whole (atomic rename) and content
addressed, so a file written by one is valid for all. The size budget is kept together by
`enforce_budget`: the writer thread counts the directory's block files every `scan_every` writes
(and at close) and deletes the least recently accessed (oldest mtime; reads refresh it) beyond the
budget, so the directory exceeds it by at most `scan_every` blocks per replica between scans. A
file another replica deleted is a clean miss here (and leaves this index on its next lookup).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import xxhash

from engine.kv.hashing import BlockHash
from engine.model_loader import safetensors_files

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


def _digest(data: Any) -> bytes:
    return xxhash.xxh3_128_digest(data)


class Ready(Protocol):
    """Completion of an asynchronous copy into a payload (a CUDA event)."""

    def synchronize(self) -> None: ...


class DiskFiles:
    """The disk tier's files: checksummed, written by a background thread, read on `probe`."""

    def __init__(
        self,
        directory: Path,
        payload_bytes: int,
        read_cache_bytes: int = READ_CACHE_BYTES,
        *,
        max_queued: int = 256,
        capacity_blocks: int | None = None,
    ) -> None:
        self.directory = directory
        self.payload_bytes = payload_bytes
        self.max_queued = max_queued
        """Stores waiting for the writer at most (more are refused by `store`)."""
        self.capacity_blocks = capacity_blocks
        """The directory's budget in block files (None: not enforced here)."""
        self.scan_every = max(1, (capacity_blocks or 0) // 32)
        """Writes between two budget scans of the directory."""
        self.num_write_errors = 0
        self.num_budget_deletes = 0
        """Files deleted by budget scans (least recently accessed in the shared directory)."""
        self.num_refused = 0
        """Stores refused because `max_queued` were waiting."""
        self._enabled = True
        self._queued_stores = 0
        self._unfinished = 0
        self._writes_since_scan = 0
        self._scan_evicted: list[BlockHash] = []
        """Hashes whose files a budget scan deleted; taken by the step thread for its index."""
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
        self._pending: dict[BlockHash, tuple[torch.Tensor, Ready | None]] = {}
        """Payloads queued for writing (readable before their file exists)."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="deja-disk-writer", daemon=True)
        self._thread.start()
        self._warm: queue.SimpleQueue[tuple[BlockHash, torch.Tensor] | None] = queue.SimpleQueue()
        self._warm_thread: threading.Thread | None = None

    @classmethod
    def open(
        cls,
        directory: str | Path,
        manifest: dict[str, Any],
        payload_bytes: int,
        read_cache_bytes: int = 0,
        *,
        max_queued: int = 256,
        capacity_blocks: int | None = None,
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
        return cls(
            root,
            payload_bytes,
            read_cache_bytes,
            max_queued=max_queued,
            capacity_blocks=capacity_blocks,
        )

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

    def enforce_budget(self) -> list[BlockHash]:
        """Deletes the least recently accessed block files beyond `capacity_blocks` (counting
        every replica's files in the directory); returns their hashes."""
        if self.capacity_blocks is None:
            return []
        found = self.scan()
        extra = found[: max(0, len(found) - self.capacity_blocks)]
        for h in extra:
            _unlink(self.path(h))
        self.num_budget_deletes += len(extra)
        return extra

    def take_budget_deletes(self) -> list[BlockHash]:
        """Hashes budget scans deleted since the last call (the step thread drops them)."""
        with self._lock:
            out, self._scan_evicted = self._scan_evicted, []
        return out

    # -- DiskIO --------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._enabled

    def probe(self, block_hash: BlockHash) -> bool:
        if block_hash in self._stored:
            return True
        if block_hash in self._buffer:
            self._buffer.move_to_end(block_hash)
            return True
        with self._lock:
            queued = self._pending.get(block_hash)
        payload = None
        if queued is not None:
            payload, ready = queued
            if ready is not None:
                ready.synchronize()
        else:
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
    def room(self) -> int:
        """Stores `store` would take now (0 when the queue is full or the tier is off)."""
        if not self._enabled:
            return 0
        with self._lock:
            return max(0, self.max_queued - self._queued_stores)

    def store(
        self, block_hash: BlockHash, payload: torch.Tensor, ready: Ready | None = None
    ) -> bool:
        """Queues a write; the payload ([payload_bytes] uint8, owned) is readable right away.

        `ready`: the copy into `payload` is asynchronous and done when it synchronizes. False
        (nothing queued) when `max_queued` stores wait or the tier is off.
        """
        if ready is None:
            # NOTE: readable in this step even when refused: a write-back store's hash may be
            # loaded later in the same step (engine/kv/tiers.py).
            self._stored[block_hash] = payload
        with self._lock:
            if not self._enabled or self._queued_stores >= self.max_queued:
                self.num_refused += self._enabled
                return False
            self._queued_stores += 1
            self._unfinished += 1
            self._pending[block_hash] = (payload, ready)
        self._queue.put(_Op("store", block_hash, payload, ready))
        return True

    def delete(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._unfinished += 1
        self._queue.put(_Op("delete", block_hash))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until every queued write and delete is done (at most `timeout_s`); True if so."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._idle:
            while self._unfinished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float | None = None) -> bool:
        """Flushes (bounded by `timeout_s`), keeps the shared budget and stops the threads.

        True when every queued write reached disk; what is left is lost, as after a crash.
        """
        done = self.flush(timeout_s)
        self._warm.put(None)
        if self._thread.is_alive():
            if done:
                self._queue.put(_Op("budget"))
            self._queue.put(None)
            self._thread.join(timeout=None if done else 0.1)
        return done

    # -- warm start ----------------------------------------------------------------------------
    def start_warm(self, hashes: list[BlockHash]) -> None:
        """Reads and verifies these blocks' files in a background thread, in order; `take_warm`
        hands over the payloads read so far."""
        if not hashes:
            return
        self._warm_thread = threading.Thread(
            target=self._read_warm, args=(hashes,), name="deja-disk-warm", daemon=True
        )
        self._warm_thread.start()

    def take_warm(self) -> list[tuple[BlockHash, torch.Tensor]]:
        out: list[tuple[BlockHash, torch.Tensor]] = []
        while True:
            try:
                item = self._warm.get_nowait()
            except queue.Empty:
                return out
            if item is None:
                self._warm_thread = None
                return out
            out.append(item)

    @property
    def warming(self) -> bool:
        return self._warm_thread is not None

    def wait_warm(self, timeout_s: float | None = None) -> None:
        """Waits for the warm-start reads to finish (tests, benchmarks)."""
        t = self._warm_thread
        if t is not None:
            t.join(timeout_s)

    def _read_warm(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            payload = self._read(h)
            if payload is not None:
                self._warm.put((h, payload))
        self._warm.put(None)

    # -- the writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            try:
                self._do(op)
            finally:
                with self._idle:
                    if op.kind == "store":
                        self._queued_stores -= 1
                        if self._pending.get(op.block_hash, (None,))[0] is op.payload:
                            del self._pending[op.block_hash]
                    if op.kind != "budget":
                        self._unfinished -= 1
                    if not self._unfinished:
                        self._idle.notify_all()

    def _do(self, op: _Op) -> None:
        if op.kind == "budget":
            self._enforce_budget_logged()
            return
        if op.kind == "delete":
            try:
                _unlink(self.path(op.block_hash))
            except OSError as exc:
                log.warning("disk tier: delete of %s failed: %s", op.block_hash.hex()[:16], exc)
            return
        if not self._enabled:
            return
        assert op.payload is not None
        if op.ready is not None:
            op.ready.synchronize()
        try:
            self._write(op.block_hash, op.payload)
        except OSError as exc:
            self._turn_off(exc)
            return
        self._writes_since_scan += 1
        if self.capacity_blocks is not None and self._writes_since_scan >= self.scan_every:
            self._enforce_budget_logged()

    def _enforce_budget_logged(self) -> None:
        self._writes_since_scan = 0
        try:
            gone = self.enforce_budget()
        except OSError as exc:
            log.warning("disk tier: budget scan of %s failed: %s", self.directory, exc)
            return
        if gone:
            with self._lock:
                self._scan_evicted += gone

    def _turn_off(self, exc: OSError) -> None:
        with self._lock:
            self.num_write_errors += 1
            was_on, self._enabled = self._enabled, False
            self._pending.clear()
        if was_on:
            log.warning(
                "disk tier off: writing into %s failed (%s); requests go on without the disk "
                "tier (see deja_cache_tier_disabled); fix the directory and restart to re-enable",
                self.directory,
                exc,
            )

    def _write(self, block_hash: BlockHash, payload: torch.Tensor) -> None:
        data = payload.numpy().data  # memoryview of the contiguous bytes
        digest = _digest(data)
        header = _HEADER.pack(_MAGIC, block_hash, data.nbytes, digest).ljust(HEADER_BYTES, b"\0")
        path = self.path(block_hash)
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
            elif _digest(payload) != digest:
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


@dataclass(frozen=True, slots=True)
class _Op:
    """One job of the writer thread."""

    kind: str
    """store, delete or budget (a budget scan)."""
    block_hash: BlockHash = b""
    payload: torch.Tensor | None = None
    ready: Ready | None = None


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
