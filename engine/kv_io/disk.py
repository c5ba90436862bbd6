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
On startup the index is rebuilt from the directory, least recently accessed (mtime) first; reads
refresh a file's mtime, coarsely and off the read path (see `TOUCH_EVERY_S`). The directory's layout,
the scan and the budget shared by replicas are engine/kv_io/disk_dir.py's; warm start (reading the
most recent files back into the CPU tier) is engine/kv_io/disk_warm.py's.

The writer never holds up the step loop: `store` takes a payload already copied off the KV cache
(the step thread's staging copy) and returns at once; at most `max_queued` stores wait, and a store
past that is refused (the caller counts it as dropped). The first failed write (read-only or full
directory, any OSError) turns the tier off: a warning, `num_write_errors`, `enabled` False, queued
writes dropped, lookups stop (requests go on without the tier).
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
from engine.kv_io.disk_dir import block_path, enforce_budget, scan, unlink
from engine.kv_io.disk_warm import WarmStart
from engine.stats import BufferStats
from engine.worker.model_loader import safetensors_files

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
TOUCH_EVERY_S = 30.0
"""A read refreshes its file's mtime (the access order budget scans and restarts use) at most
this often per file, and on the writer thread (`end_step` hands them over in one batch): an
inline utime per read cost ~25% of the read. The access order is right to within this long."""
_MAX_TOUCHED = 1 << 16
READ_CACHE_BYTES = 32 * 2**20
"""Verified disk payloads an engine keeps in memory across steps, in bytes at most ..."""
READ_CACHE_SHARE = 1 / 8
"""... and as a share of the tier's capacity at most (a cache larger than the tier it caches
only holds memory: the soak's 145-block tier had a 182-block read cache)."""
WRITE_QUEUE_BYTES = 64 * 2**20
"""Payloads waiting for the writer thread, in bytes at most (besides `max_queued` blocks) ..."""
WRITE_QUEUE_SHARE = 1 / 4
"""... and as a share of the tier's capacity at most."""


def buffer_blocks(
    limit_bytes: int, payload_bytes: int, capacity_blocks: int | None, share: float
) -> int:
    """Blocks a host buffer of the disk tier may hold: `limit_bytes` of payloads and `share` of
    the tier's capacity at most, one at least."""
    n = limit_bytes // payload_bytes
    if capacity_blocks is not None:
        n = min(n, int(capacity_blocks * share))
    return max(1, n)


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
        write_queue_bytes: int = WRITE_QUEUE_BYTES,
        capacity_blocks: int | None = None,
    ) -> None:
        self.directory = directory
        self.payload_bytes = payload_bytes
        self.max_queued = min(
            max_queued,
            buffer_blocks(write_queue_bytes, payload_bytes, capacity_blocks, WRITE_QUEUE_SHARE),
        )
        """Stores waiting for the writer at most (more are refused by `store`): `max_queued`,
        `write_queue_bytes` of payloads and WRITE_QUEUE_SHARE of the tier at most."""
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
        self.read_cache_blocks = (
            buffer_blocks(read_cache_bytes, payload_bytes, capacity_blocks, READ_CACHE_SHARE)
            if read_cache_bytes >= payload_bytes
            else 0
        )
        """Verified payloads kept past the end of a step (least recently used dropped first):
        `read_cache_bytes` and READ_CACHE_SHARE of the tier at most."""
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
        self._warm: WarmStart | None = None
        self._root = str(directory)
        self._touched: dict[BlockHash, float] = {}
        """When `read` last queued a file's mtime refresh (monotonic s), by hash; bounded."""
        self._max_touched = min(_MAX_TOUCHED, max(1024, 2 * (capacity_blocks or _MAX_TOUCHED)))
        self._to_touch: list[BlockHash] = []
        """Hashes read in this step whose mtime refresh is due (step thread)."""

    @classmethod
    def open(
        cls,
        directory: str | Path,
        manifest: dict[str, Any],
        payload_bytes: int,
        read_cache_bytes: int = 0,
        *,
        max_queued: int = 256,
        write_queue_bytes: int = WRITE_QUEUE_BYTES,
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
            if any(root.glob("??/*.kv")):
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
            write_queue_bytes=write_queue_bytes,
            capacity_blocks=capacity_blocks,
        )

    def path(self, block_hash: BlockHash) -> Path:
        return block_path(self.directory, block_hash)

    def scan(self) -> list[BlockHash]:
        """Hashes of the block files in the directory, least recently accessed first."""
        return scan(self.directory, HEADER_BYTES + self.payload_bytes, self._drop_bad)

    def enforce_budget(self) -> list[BlockHash]:
        """Deletes the least recently accessed block files beyond `capacity_blocks` (counting
        every replica's files in the directory); returns their hashes."""
        if self.capacity_blocks is None:
            return []
        gone = enforce_budget(
            self.directory, self.capacity_blocks, HEADER_BYTES + self.payload_bytes, self._drop_bad
        )
        self.num_budget_deletes += len(gone)
        return gone

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
            payload = self.read(block_hash)
        if payload is None:
            return False
        self._buffer[block_hash] = payload
        return True

    def end_step(self) -> None:
        self._stored.clear()
        if self._to_touch:
            hashes, self._to_touch = tuple(self._to_touch), []
            with self._lock:
                on = self._enabled
                self._unfinished += on
            if on:
                self._queue.put(_Op("touch", hashes=hashes))
        while len(self._buffer) > self.read_cache_blocks:
            self._buffer.popitem(last=False)

    def buffered(self, block_hash: BlockHash) -> torch.Tensor:
        """The payload that `probe` or `store` made available in this step."""
        payload = self._stored.get(block_hash)
        return payload if payload is not None else self._buffer[block_hash]

    def buffers(self) -> list[BufferStats]:
        """The tier's host buffers: the read cache and the write queue (sizes now, caps)."""
        with self._lock:
            queued = self._queued_stores
        p = self.payload_bytes
        return [
            BufferStats(
                "disk_read_cache",
                len(self._buffer),
                len(self._buffer) * p,
                self.read_cache_blocks,
                self.read_cache_blocks * p,
            ),
            BufferStats(
                "disk_write_queue", queued, queued * p, self.max_queued, self.max_queued * p
            ),
        ]

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
        if self._warm is not None:
            self._warm.stop()
        if self._thread.is_alive():
            if done:
                self._queue.put(_Op("budget"))
            self._queue.put(None)
            self._thread.join(timeout=None if done else 0.1)
        return done

    # -- warm start (engine/kv_io/disk_warm.py) ---------------------------------------------------
    def start_warm(self, hashes: list[BlockHash]) -> None:
        """Reads and verifies these blocks' files in a background thread, in order; `take_warm`
        hands over the payloads read so far."""
        if hashes:
            self._warm = WarmStart(self._read, hashes)

    def take_warm(self) -> list[tuple[BlockHash, torch.Tensor]]:
        if self._warm is None:
            return []
        out = self._warm.take()
        if self._warm.done:
            self._warm = None
        return out

    @property
    def warming(self) -> bool:
        return self._warm is not None

    def wait_warm(self, timeout_s: float | None = None) -> None:
        """Waits for the warm-start reads to finish (tests, benchmarks)."""
        if self._warm is not None:
            self._warm.wait(timeout_s)

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
        if op.kind == "touch":
            for h in op.hashes:
                with contextlib.suppress(OSError):
                    os.utime(self.path(h))  # the access order of budget scans and restarts
            return
        if op.kind == "budget":
            self._enforce_budget_logged()
            return
        if op.kind == "delete":
            try:
                unlink(self.path(op.block_hash))
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

    def read(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block's verified payload ([payload_bytes] uint8, owned) from its file, or None
        (missing, or bad and deleted). The file's mtime refresh, due at most every TOUCH_EVERY_S,
        is handed to the writer thread by `end_step`."""
        payload = self._read(block_hash)
        if payload is not None:
            now = time.monotonic()
            last = self._touched.get(block_hash)
            if last is None or now - last >= TOUCH_EVERY_S:
                if len(self._touched) >= self._max_touched:
                    self._touched.clear()
                self._touched[block_hash] = now
                self._to_touch.append(block_hash)
        return payload

    def _read(self, block_hash: BlockHash) -> torch.Tensor | None:
        """Reads and verifies one file (any thread); no mtime refresh (`read` does that)."""
        name = block_hash.hex()
        path = f"{self._root}/{name[:2]}/{name}.kv"
        expected = HEADER_BYTES + self.payload_bytes
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
        reason = None
        if size != expected or n != expected:
            reason = f"size {size if size != expected else n}, expected {expected}"
        else:
            magic, stored_hash, length, digest = _HEADER.unpack_from(view)
            if magic != _MAGIC:
                reason = "bad magic"
            elif stored_hash != block_hash:
                reason = "header names another block"
            elif length != self.payload_bytes:
                reason = f"payload length {length}"
            elif _digest(view[HEADER_BYTES:]) != digest:
                reason = "checksum mismatch"
        if reason is not None:
            self._drop_bad(Path(path), reason)
            return None
        return buf[HEADER_BYTES:]

    def _drop_bad(self, path: Path, reason: str) -> None:
        self.num_bad += 1
        log.warning("disk tier: deleting bad block file %s (%s); it is a cache miss", path, reason)
        unlink(path)


@dataclass(frozen=True, slots=True)
class _Op:
    """One job of the writer thread."""

    kind: str
    """store, delete, budget (a budget scan) or touch (refresh the mtimes of `hashes`)."""
    block_hash: BlockHash = b""
    payload: torch.Tensor | None = None
    ready: Ready | None = None
    hashes: tuple[BlockHash, ...] = ()
