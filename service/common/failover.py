"""The replica -> router contract for a replica whose engine core died under an open stream.

A replica ends every open `Generate` stream with UNAVAILABLE and a message when its engine core
dies (a tensor-parallel worker's death kills the core too): the replica cannot
serve, the request itself was fine, and the caller may send it elsewhere. It also sends, in the
trailing metadata, `deja-engine-dead: <messages sent>` (the number of response messages that
stream had already sent). The router retries such a stream on another replica only when nothing
of it reached the client: no message relayed by the router and `<messages sent>` is 0. A stream
that has streamed a token is never retried (the client has text it would otherwise see twice);
it fails with the replica's UNAVAILABLE. Replicas before this change sent INTERNAL with the same
trailer; the router reads both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

ENGINE_DEAD_KEY = "deja-engine-dead"
"""Trailing metadata key; the value is the number of response messages the stream had sent."""


def engine_dead_trailer(messages_sent: int) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a replica sends with UNAVAILABLE when its engine core died."""
    return ((ENGINE_DEAD_KEY, str(messages_sent)),)


def engine_dead_sent(trailing: Iterable[Any] | None) -> int | None:
    """The messages the stream had sent when its engine core died (the trailer's value); None
    when the trailer is absent (not an engine death)."""
    for item in trailing or ():
        key, value = item[0], item[1]
        if key == ENGINE_DEAD_KEY:
            try:
                return int(value)
            except (TypeError, ValueError):
                return 1  # unreadable: assume output was sent (never retried)
    return None


def engine_dead_before_output(trailing: Iterable[Any] | None) -> bool:
    """True when the trailer says the engine core died before the stream sent any message."""
    return engine_dead_sent(trailing) == 0
