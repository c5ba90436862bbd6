"""Giving freed host memory back to the OS between steps (glibc's `malloc_trim`).

The disk tier moves one block at a time through host buffers of a few hundred KiB to a few MiB
(read payloads, write-queue snapshots, staging tensors), allocated on the step thread and freed
on the writer thread or when a cache drops them. glibc serves such sizes from its heap once its
dynamic mmap threshold has risen (it does so the first time a large mmapped chunk is freed), and
freed chunks in the middle of the heap stay resident: RSS then climbs to the high-water mark of
every burst and looks like a leak. Measured with the disk tier's allocation pattern (block
payloads of 720 KiB, a writer thread freeing them, a 182-block read cache): RSS 945 MiB with
517 MiB of it free heap, 362-515 MiB with a `malloc_trim(0)` every 50 steps.

NOTE: trimming, not a fixed `M_MMAP_THRESHOLD`: a fixed threshold (same RSS effect in the
measurement above) would also send every activation tensor of the forward pass through
mmap/munmap and its page faults, each step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

TRIM_EVERY_S = 10.0
"""Seconds between two trims at most (one trim of a ~1 GiB heap takes a few ms)."""


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        fn = libc.malloc_trim  # glibc only (not musl, not macOS)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


class HostMemoryTrimmer:
    """Calls `malloc_trim(0)` at most every `every_s` seconds (a no-op without glibc)."""

    def __init__(self, every_s: float = TRIM_EVERY_S) -> None:
        self.every_s = every_s
        self._trim = _load_malloc_trim()
        self._last = time.monotonic()
        self.num_trims = 0
        self.seconds = 0.0
        """Time spent trimming in total."""

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe_trim(self, now: float | None = None) -> bool:
        """Trims when `every_s` has passed since the last trim; True when it trimmed."""
        now = time.monotonic() if now is None else now
        if self._trim is None or now - self._last < self.every_s:
            return False
        self._last = now
        self._trim(0)
        self.num_trims += 1
        self.seconds += time.monotonic() - now
        return True
