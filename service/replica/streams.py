"""The bookkeeping of open Generate calls: `Stream` (what admission control, Abort and drain see)
and `StreamRecord` (one call as it runs, and how it ended)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

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
