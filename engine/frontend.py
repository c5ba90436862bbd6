"""Reading one request's outputs from its queue: the loop both engine front ends share.

`engine/async_engine.py` (step loop in a thread) and `engine/core_client.py` (engine core in a
process) each put a request's deltas, or an exception that ends it, on an asyncio queue; the
request's `generate()` reads them with `read_outputs` until the finished delta.
"""

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

    A queued exception is raised to the reader. `on_read()` runs after each item is taken.
    `leave(finished)` runs however the reader leaves (finished, an error, `aclose()`), with
    finished False when the request is still running and must be aborted.
    """
    finished = False
    try:
        start()
        while True:
            item = await queue.get()
            if on_read is not None:
                on_read()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        leave(finished)
