"""What the two engine front ends share: `EngineFrontend` and `read_outputs`.

`engine/frontend/async_engine.py` (step loop in a thread) and `engine/frontend/core_client.py` (engine core in a
process) both serve the replica's `Engine` protocol: the model's facts, the latest stats snapshot,
tokenization with the engine's own rule (`engine/frontend/input_processor.py`), and one asyncio queue per
request onto which they put its deltas, or an exception that ends it; the request's `generate()`
reads the queue with `read_outputs` until the finished delta.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any

from engine.frontend.input_processor import InputProcessor
from engine.frontend.prompt import Prompt
from engine.outputs import RequestOutput
from engine.sample.sampling_params import SamplingParams
from engine.stats import EngineStats, ModelInfo


class EngineFrontend:
    """The facts, stats and tokenization both front ends answer from the API server's side."""

    _model_info: ModelInfo
    _stats: EngineStats
    """The engine's latest snapshot (refreshed by the step loop or the core's messages)."""
    _inputs: InputProcessor

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    def get_stats(self) -> EngineStats:
        """The latest snapshot the engine sent (never blocks)."""
        return self._stats

    def tokenize(
        self, text: Prompt | None = None, messages: list[dict[str, str]] | None = None
    ) -> list[int]:
        return self._inputs.tokenize(text, messages)

    def check_health(self) -> None:
        """Raises EngineDeadError when the engine has failed."""
        raise NotImplementedError

    async def generate(
        self,
        prompt: Prompt | None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        messages: list[dict[str, str]] | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams deltas of one request; leaving early aborts it and frees its blocks.

        Raises ValueError (bad input, a request id in use) at the first iteration.
        """
        self.check_health()
        inputs = {
            "prompt": prompt,
            "params": params,
            "messages": messages,
            "cache_salt": cache_salt,
        }
        outputs = self._open(request_id, inputs)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield out

    def _open(
        self, request_id: str | None, inputs: dict[str, Any]
    ) -> AsyncGenerator[RequestOutput, None]:
        """Prepares (`inputs`: prompt, params, messages, cache_salt) and registers the request;
        returns its deltas, read with `read_outputs`."""
        raise NotImplementedError


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
