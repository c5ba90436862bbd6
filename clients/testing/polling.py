"""Waiting for a started process to become ready: poll it, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable


def poll_until(
    ready: Callable[[], bool],
    timeout_s: float,
    interval_s: float,
    *,
    check_alive: Callable[[], None],
    timeout_error: Callable[[], Exception],
) -> None:
    """Returns once `ready()` is true. `check_alive` raises when the process has died; an OSError
    from `ready` (not listening yet) counts as not ready; after `timeout_s` raises
    `timeout_error()`."""
    deadline = time.monotonic() + timeout_s
    while True:
        check_alive()
        try:
            if ready():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise timeout_error()
        time.sleep(interval_s)
