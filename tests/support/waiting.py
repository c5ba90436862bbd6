"""One way for a test to wait for something to happen: poll a condition, with a deadline.

Tests synchronise on what they wait for, never on a fixed sleep: a loaded machine makes a sleep
too short (a flake), an idle one makes it too long (a slow suite).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]],
    timeout: float = 10.0,
    *,
    interval: float = 0.02,
    what: str = "",
) -> None:
    """Returns once `condition()` (sync or async) is true; fails the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        await asyncio.sleep(interval)


def wait_until_sync(
    condition: Callable[[], bool], timeout: float = 10.0, *, interval: float = 0.05, what: str = ""
) -> bool:
    """`wait_until` for code without an event loop; returns whether the condition came true."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True
