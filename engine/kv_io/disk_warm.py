"""Warm start of the disk tier: the most recently used block files read back in the background.

With `warm_start_blocks` N, the engine's start hands the N most recently accessed hashes of the
rebuilt disk index (most recent first) to a `WarmStart`; its thread reads and verifies their files
in that order, and the step thread takes what has arrived between steps and copies it into never
used CPU blocks (engine/kv_io/offload.py, `TieredCache.warm_target`), so the first requests after a
restart hit the CPU tier. Warm start never evicts; a block that does not fit is left on disk.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from engine.kv.hashing import BlockHash


class WarmStart:
    """Reads block files in a background thread; `take` hands over the payloads read so far."""

    def __init__(
        self, read: Callable[[BlockHash], torch.Tensor | None], hashes: list[BlockHash]
    ) -> None:
        self._read = read
        self._queue: queue.SimpleQueue[tuple[BlockHash, torch.Tensor] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.done = False
        """True once every payload read has been taken (or warm start was stopped)."""
        self._thread = threading.Thread(
            target=self._run, args=(hashes,), name="deja-disk-warm", daemon=True
        )
        self._thread.start()

    def take(self) -> list[tuple[BlockHash, torch.Tensor]]:
        out: list[tuple[BlockHash, torch.Tensor]] = []
        while not self.done:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self.done = True
            else:
                out.append(item)
        return out

    def wait(self, timeout_s: float | None = None) -> None:
        """Waits for the reads to finish (tests, benchmarks)."""
        self._thread.join(timeout_s)

    def stop(self) -> None:
        """Stops reading (what was read stays takeable); does not wait."""
        self._stop.set()

    def _run(self, hashes: list[BlockHash]) -> None:
        try:
            for h in hashes:
                if self._stop.is_set():
                    break
                payload = self._read(h)
                if payload is not None:
                    self._queue.put((h, payload))
        finally:
            self._queue.put(None)
