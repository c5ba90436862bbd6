"""The disk tier's files: content-addressed, checksummed, shared safely between replicas.

One file per block, in the format of engine/kv_io/disk_format.py (a checksummed header and the
block's bytes; `manifest.json` binds the directory to the model and KV layout). Files are written
by one writer thread (engine/kv_io/disk_writer.py) from snapshots of CPU blocks taken before the
CPU block is reused; the first failed write turns the tier off and lookups stop (requests go on
without the tier).
A file that is missing, truncated, corrupt (checksum) or for another block is deleted and is a
miss: it is detected when `find` probes it, before the manager plans a load (see
engine/kv/disk_tier.py).
On startup the index is rebuilt from the directory, least recently accessed (mtime) first; reads
refresh a file's mtime, coarsely and off the read path (see `TOUCH_EVERY_S`). The directory's layout,
the scan and the budget shared by replicas are engine/kv_io/disk_dir.py's; warm start (reading the
most recent files back into the CPU tier) is engine/kv_io/disk_warm.py's.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.kv.hashing import BlockHash
from engine.kv_io.disk_dir import block_path, enforce_budget, scan, unlink
from engine.kv_io.disk_format import (
    HEADER_BYTES,
    NO_TAG,
    BadBlockFile,
    claim_directory,
    manifest_tag,
    read_block_file,
)
from engine.kv_io.disk_warm import WarmStart
from engine.kv_io.disk_writer import DiskWriter, Ready
from engine.stats import BufferStats

log = logging.getLogger(__name__)

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
        tag: bytes = NO_TAG,
    ) -> None:
        self.directory = directory
        self.payload_bytes = payload_bytes
        self.tag = tag
        """The manifest's tag: block files carry it, a file with another one is a miss."""
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
        self.num_budget_deletes = 0
        """Files deleted by budget scans (least recently accessed in the shared directory)."""
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
        self._writer = DiskWriter(
            directory,
            self.max_queued,
            scan_every=self.scan_every if capacity_blocks is not None else None,
            enforce_budget=self.enforce_budget,
            tag=tag,
        )
        self._warm: WarmStart | None = None
        self._root = str(directory)
        self._touched: dict[BlockHash, float] = {}
        """When `read` last queued a file's mtime refresh (monotonic s), by hash; bounded."""
        self._max_touched = min(_MAX_TOUCHED, max(1024, 2 * (capacity_blocks or _MAX_TOUCHED)))
        self._to_touch: list[BlockHash] = []
        """Hashes read in this step whose mtime refresh is due (step thread)."""
        self.peers_probe: Callable[[BlockHash], bool] | None = None
        """Tensor-parallel rank 0: whether every other rank verified its share of the block
        (engine/worker/parallel/executor.py); a hit needs all of them."""

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
        if not claim_directory(root, manifest):
            return None
        return cls(
            root,
            payload_bytes,
            read_cache_bytes,
            max_queued=max_queued,
            write_queue_bytes=write_queue_bytes,
            capacity_blocks=capacity_blocks,
            tag=manifest_tag(manifest),
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
        return self._writer.take_budget_deletes()

    # -- DiskIO --------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False once a write failed (the writer turned the tier off)."""
        return self._writer.enabled

    def probe(self, block_hash: BlockHash) -> bool:
        if not self._probe(block_hash):
            return False
        if self.peers_probe is None or self.peers_probe(block_hash):
            return True
        # another rank lacks its share (a refused or failed write, a budget scan): this
        # share alone is of no use, so it goes too
        self._buffer.pop(block_hash, None)
        self.delete(block_hash)
        return False

    def _probe(self, block_hash: BlockHash) -> bool:
        if block_hash in self._stored:
            return True
        if block_hash in self._buffer:
            self._buffer.move_to_end(block_hash)
            return True
        queued = self._writer.pending(block_hash)
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
            self._writer.touch(hashes)
        while len(self._buffer) > self.read_cache_blocks:
            self._buffer.popitem(last=False)

    def buffered(self, block_hash: BlockHash) -> torch.Tensor:
        """The payload that `probe` or `store` made available in this step."""
        payload = self._stored.get(block_hash)
        return payload if payload is not None else self._buffer[block_hash]

    def buffers(self) -> list[BufferStats]:
        """The tier's host buffers: the read cache and the write queue (sizes now, caps)."""
        queued = self._writer.queued
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

    # -- writes (engine/kv_io/disk_writer.py) --------------------------------------------------
    def room(self) -> int:
        """Stores `store` would take now (0 when the queue is full or the tier is off)."""
        return self._writer.room()

    def store(
        self, block_hash: BlockHash, payload: torch.Tensor, ready: Ready | None = None
    ) -> bool:
        """Queues a write; the payload ([payload_bytes] uint8, owned) is readable right away.

        `ready`: the copy into `payload` is asynchronous and done when it synchronizes. False
        (nothing queued) when `max_queued` stores wait or the tier is off.
        """
        if ready is None:
            # NOTE: readable in this step even when refused: a write-back store's hash may be
            # loaded later in the same step (engine/kv/disk_tier.py).
            self._stored[block_hash] = payload
        return self._writer.store(block_hash, payload, ready)

    @property
    def num_refused(self) -> int:
        """Stores refused because `max_queued` were waiting."""
        return self._writer.num_refused

    def delete(self, block_hash: BlockHash) -> None:
        self._writer.delete(block_hash)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until every queued write and delete is done (at most `timeout_s`); True if so."""
        return self._writer.flush(timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Flushes (bounded by `timeout_s`), keeps the shared budget and stops the threads.

        True when every queued write reached disk; what is left is lost, as after a crash.
        """
        done = self.flush(timeout_s)
        if self._warm is not None:
            self._warm.stop()
        self._writer.stop(flushed=done)
        return done

    @property
    def num_write_errors(self) -> int:
        """Writes that failed (the first one turned the tier off)."""
        return self._writer.num_write_errors

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

    # -- reads ---------------------------------------------------------------------------------
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
        try:
            return read_block_file(path, block_hash, self.payload_bytes, self.tag)
        except BadBlockFile as exc:
            self._drop_bad(Path(path), exc.reason)
            return None

    def _drop_bad(self, path: Path, reason: str) -> None:
        self.num_bad += 1
        log.warning("disk tier: deleting bad block file %s (%s); it is a cache miss", path, reason)
        unlink(path)
