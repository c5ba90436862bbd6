"""`read_outputs`: one request's stream of deltas, read off its queue (engine/frontend/
engine_client.py puts the core's deltas, or an exception that ends the stream, on it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from engine.outputs import RequestOutput


async def read_outputs(
    queue: asyncio.Queue[RequestOutput | BaseException],
    *,
    start: Callable[[], None],
    leave: Callable[[bool], None],
    on_read: Callable[[], None] | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """Runs `start()` (submits the request), then yields its deltas until the finished one.

    Deltas already queued when the reader takes one are merged into it (`RequestOutput.merge`):
    a reader that falls behind gets one message for all it missed, not one per step.
    A queued exception is raised to the reader (after the deltas queued before it).
    `on_read()` runs after each item is taken. `leave(finished)` runs however the reader leaves
    (finished, an error, `aclose()`), with finished False when the request is still running and
    must be aborted.
    """
    finished = False
    held: RequestOutput | BaseException | None = None
    """An item taken off the queue while merging and not yet handed out (an exception)."""
    try:
        start()
        while True:
            if held is not None:
                item, held = held, None
            else:
                item = await queue.get()
                if on_read is not None:
                    on_read()
            if isinstance(item, BaseException):
                raise item
            while not item.finished and not queue.empty():
                later = queue.get_nowait()
                if on_read is not None:
                    on_read()
                if isinstance(later, BaseException):
                    held = later
                    break
                item = item.merge(later)
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        leave(finished)
