"""The disk tier's writer thread: block files written, deleted and touched off the step loop.

The writer never holds up the step loop: `store` takes a payload already copied off the KV cache
(the step thread's staging copy) and returns at once; at most `max_queued` stores wait, and a store
past that is refused (the caller counts it as dropped). A queued payload stays readable
(`pending`) until its file exists. The first failed write (read-only or full directory, any
OSError) turns the tier off: a warning, `num_write_errors`, `enabled` False, queued writes
dropped. Every `scan_every` writes (and at `stop`) the thread keeps the directory within the
budget shared by replicas (engine/kv_io/disk_dir.py); the hashes a scan deleted wait in
`take_budget_deletes` for the step thread's index.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from engine.kv.hashing import BlockHash
from engine.kv_io.disk_dir import block_path, unlink
from engine.kv_io.disk_format import NO_TAG, write_block_file

log = logging.getLogger(__name__)


def wait_until_idle(
    idle: threading.Condition, busy: Callable[[], int], timeout_s: float | None
) -> bool:
    """Waits until `busy()` (read under `idle`'s lock, whose holder notifies when it reaches 0)
    is 0, at most `timeout_s`; True if it did."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with idle:
        while busy():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            idle.wait(left)
    return True


class Ready(Protocol):
    """Completion of an asynchronous copy into a payload (a CUDA event)."""

    def synchronize(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Op:
    """One job of the writer thread."""

    kind: str
    """store, delete, budget (a budget scan) or touch (refresh the mtimes of `hashes`)."""
    block_hash: BlockHash = b""
    payload: torch.Tensor | None = None
    ready: Ready | None = None
    hashes: tuple[BlockHash, ...] = ()


class DiskWriter:
    """One thread that writes, deletes and touches the block files of `directory`, in order."""

    def __init__(
        self,
        directory: Path,
        max_queued: int,
        *,
        scan_every: int | None,
        enforce_budget: Callable[[], list[BlockHash]],
        tag: bytes = NO_TAG,
    ) -> None:
        self.directory = directory
        self._tag = tag
        """The directory manifest's tag, written into every block file's header."""
        self._max_queued = max_queued
        self._scan_every = scan_every
        """Writes between two budget scans (None: no scans between writes)."""
        self._enforce_budget = enforce_budget
        """Deletes the files beyond the shared budget; returns their hashes (any thread)."""
        self.num_write_errors = 0
        self.num_refused = 0
        """Stores refused because `max_queued` were waiting."""
        self._enabled = True
        self._queued_stores = 0
        self._unfinished = 0
        self._writes_since_scan = 0
        self._scan_evicted: list[BlockHash] = []
        """Hashes whose files a budget scan deleted; taken by the step thread for its index."""
        self._pending: dict[BlockHash, tuple[torch.Tensor, Ready | None]] = {}
        """Payloads queued for writing (readable before their file exists)."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="deja-disk-writer", daemon=True)
        self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def queued(self) -> int:
        """Stores waiting now."""
        with self._lock:
            return self._queued_stores

    def room(self) -> int:
        """Stores `store` would take now (0 when the queue is full or the tier is off)."""
        if not self._enabled:
            return 0
        with self._lock:
            return max(0, self._max_queued - self._queued_stores)

    def pending(self, block_hash: BlockHash) -> tuple[torch.Tensor, Ready | None] | None:
        """The payload queued for this hash (and its copy's completion), if one waits."""
        with self._lock:
            return self._pending.get(block_hash)

    def store(self, block_hash: BlockHash, payload: torch.Tensor, ready: Ready | None) -> bool:
        """Queues a write; False (nothing queued) when `max_queued` stores wait or the tier is
        off."""
        with self._lock:
            if not self._enabled or self._queued_stores >= self._max_queued:
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

    def touch(self, hashes: tuple[BlockHash, ...]) -> None:
        """Refreshes these files' mtimes (the access order of budget scans and restarts)."""
        with self._lock:
            on = self._enabled
            self._unfinished += on
        if on:
            self._queue.put(_Op("touch", hashes=hashes))

    def take_budget_deletes(self) -> list[BlockHash]:
        """Hashes budget scans deleted since the last call (the step thread drops them)."""
        with self._lock:
            out, self._scan_evicted = self._scan_evicted, []
        return out

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until every queued write and delete is done (at most `timeout_s`); True if so."""
        return wait_until_idle(self._idle, lambda: self._unfinished, timeout_s)

    def stop(self, flushed: bool) -> None:
        """Stops the thread: after a budget scan when the queue was `flushed`, else at once (what
        is left is lost, as after a crash)."""
        if self._thread.is_alive():
            if flushed:
                self._queue.put(_Op("budget"))
            self._queue.put(None)
            self._thread.join(timeout=None if flushed else 0.1)

    # -- the thread ----------------------------------------------------------------------------
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
                    os.utime(block_path(self.directory, h))
            return
        if op.kind == "budget":
            self._enforce_budget_logged()
            return
        if op.kind == "delete":
            try:
                unlink(block_path(self.directory, op.block_hash))
            except OSError as exc:
                log.warning("disk tier: delete of %s failed: %s", op.block_hash.hex()[:16], exc)
            return
        if not self._enabled:
            return
        assert op.payload is not None
        if op.ready is not None:
            op.ready.synchronize()
        try:
            path = block_path(self.directory, op.block_hash)
            write_block_file(path, op.block_hash, op.payload, self._tag)
        except OSError as exc:
            self._turn_off(exc)
            return
        self._writes_since_scan += 1
        if self._scan_every is not None and self._writes_since_scan >= self._scan_every:
            self._enforce_budget_logged()

    def _enforce_budget_logged(self) -> None:
        self._writes_since_scan = 0
        try:
            gone = self._enforce_budget()
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
