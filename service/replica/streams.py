"""The bookkeeping of open Generate calls: `Stream` (what admission control, Abort and drain see)
and `StreamRecord` (one call as it runs, and how it ended)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from engine.errors import EngineDeadError, StreamOverflowError
from engine.outputs import RequestOutput
from service.api.deja.v1 import inference_pb2 as pb
from service.common.failover import engine_dead_trailer
from service.replica import convert

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Stream:
    """One open Generate call."""

    engine_id: str
    client_id: str
    tenant: str | None
    queued: bool = True
    """Admitted but no output yet (what admission control counts)."""
    done: bool = False


@dataclass(slots=True)
class StreamRecord:
    """One Generate call as it runs: what it streamed, how it ended, its span."""

    request: pb.GenerateRequest
    stream: Stream
    salt: str | None
    """The cache salt the engine hashes with (also what the replica agent records)."""
    span: Span
    outputs: AsyncIterator[RequestOutput]
    """The engine's deltas for this request."""
    tally: convert.StreamTally = field(default_factory=convert.StreamTally)
    last: RequestOutput | None = None
    outcome: str = "cancelled"
    """The `outcome` label of deja_requests_total (cancelled until the stream says otherwise)."""
    error: str | None = None
    """Set when the call must end with an error status (`_fail` maps outcome to the code)."""
    last_token_t: float | None = None
    sent: int = 0
    """Response messages yielded so far."""
    trailer: tuple[tuple[str, str], ...] = ()
    """Trailing metadata of the error status (the engine-dead marker for the router)."""
    finish_reasons: list[str] = field(default_factory=list)
    """The finish reason of each sample that has ended (the tally's, as of its last end)."""

    def failed(self, e: Exception) -> None:
        """Maps an exception from the engine's stream to the call's outcome and error."""
        if isinstance(e, ValueError):
            if self.last is not None:
                self.outcome, self.error = "internal", f"engine failed mid-stream: {e}"
            else:
                self.outcome, self.error = "invalid_argument", str(e)
        elif isinstance(e, StreamOverflowError):
            self.outcome, self.error = "stream_overflow", str(e)
        elif isinstance(e, EngineDeadError):
            self.outcome = "engine_dead"
            self.error = f"engine failed: {e}; this replica cannot serve (retry elsewhere)"
            self.trailer = engine_dead_trailer(self.sent)
        else:
            log.exception("request %s failed", self.stream.client_id)
            self.outcome, self.error = "internal", f"engine failed: {type(e).__name__}: {e}"

    async def responses(
        self,
        itl: Any,
        replica_id: str,
        on_finished: Callable[[str, list[int], str | None], None] | None,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The engine's deltas as response messages, up to the final one (or an engine error);
        `itl` is the inter-token latency histogram, `on_finished(session_id, prompt ids, salt)`
        runs when the request ends well."""
        async with contextlib.aclosing(self.outputs):  # type: ignore[type-var]
            async for out in self.outputs:
                self.stream.queued = False
                self._observe_itl(itl, self.tally.add(out), out)
                if any(c.finish_reason is not None for c in out.outputs):
                    self.finish_reasons = self.tally.finish_reasons()
                resp = self._response(out, first=self.last is None)
                self.last = out
                if out.finished:
                    self.stream.done = True
                    if out.error or "error" in self.tally.finish_reasons():
                        self.outcome, self.error = "error", out.error or "engine error"
                        return
                    resp.final.CopyFrom(
                        convert.final_message(out, self.tally, replica_id=replica_id)
                    )
                    self.outcome = self.tally.finish_reasons()[0] if self.tally.ends else "stop"
                    if on_finished is not None:
                        on_finished(self.request.session_id, out.prompt_token_ids, self.salt)
                yield resp

    def _observe_itl(self, itl: Any, new_tokens: int, out: RequestOutput) -> None:
        """Inter-token latency: the gap since the last delta, spread over its new tokens. The
        tokens that came with each sample's first (a reader behind gets merged deltas) had none."""
        if not new_tokens:
            return
        now = time.monotonic()
        if self.last_token_t is not None:
            gap = (now - self.last_token_t) / new_tokens
            for _ in range(new_tokens):
                itl.observe(gap)
        else:
            for _ in range(new_tokens - sum(1 for c in out.outputs if c.token_ids)):
                itl.observe(0.0)
        self.last_token_t = now

    def _response(self, out: RequestOutput, *, first: bool) -> pb.GenerateResponse:
        request = self.request
        resp = pb.GenerateResponse(request_id=self.stream.client_id)
        if request.return_token_ids and first:
            resp.prompt_token_ids.extend(out.prompt_token_ids)
        for c in out.outputs:
            resp.choices.append(convert.choice_delta(c, return_token_ids=request.return_token_ids))
        return resp
