"""When the router tries a Generate stream again on another replica.

A stream is retried only while nothing of it reached the caller (the router relayed no message),
on a replica not yet tried for this request (the servicer excludes each one it tried), at most
`max_attempts` times, and each attempt gets what is left of the caller's deadline. Only failures
of the replica are retried, never failures of the request:

    status                               reason        what happened
    UNAVAILABLE                          unavailable   connection refused or reset (the replica
                                                       was killed, mid-prefill included), it is
                                                       draining, or its engine core was dead
                                                       when the call arrived
    UNAVAILABLE + `deja-engine-dead: 0`  engine_dead   the engine core died before the stream
                                                       sent anything (service/common/failover.py;
                                                       INTERNAL + the trailer from older replicas)
    RESOURCE_EXHAUSTED (queue full)      queue_full    the replica's admission limit

Never retried: an UNAVAILABLE or INTERNAL whose engine-dead trailer says the replica had sent
messages (whatever the router relayed: the caller may hold text), INVALID_ARGUMENT,
UNAUTHENTICATED, DEADLINE_EXCEEDED, CANCELLED, an INTERNAL without the engine-dead trailer (a request that breaks one engine may break the next), and the
RESOURCE_EXHAUSTED that are the request's own fault: gRPC's message size limit, and a stream
aborted because its reader was too slow. Another replica would refuse those too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from service.common.failover import engine_dead_sent

CALLER_FAULT_EXHAUSTED = ("larger than max", "read the stream too slowly")
"""Details of a RESOURCE_EXHAUSTED that the request caused (gRPC's message size check; the
replica's slow-reader abort, service/replica/generate.py)."""

RETRY_REASONS = ("unavailable", "engine_dead", "queue_full")
"""The `reason` label of deja_router_retries_total."""


def retry_reason(
    code: grpc.StatusCode, details: str | None, trailing: Iterable[Any] | None
) -> str | None:
    """Why a Generate that failed with `code` before its first message may go to another replica
    (one of RETRY_REASONS); None when it must not."""
    dead = engine_dead_sent(trailing)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL) and dead is not None:
        return "engine_dead" if dead == 0 else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        text = (details or "").lower()
        return None if any(s in text for s in CALLER_FAULT_EXHAUSTED) else "queue_full"
    return None


def replica_is_down(reason: str) -> bool:
    """Whether the failure says the replica cannot take streams now (the pool marks it down
    until a poll finds it healthy again); a full queue is only busy."""
    return reason in ("unavailable", "engine_dead")
