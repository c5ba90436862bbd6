"""The replica -> router contract for a replica whose engine core died under an open stream.

A replica ends every open `Generate` stream with INTERNAL and a message when its engine core
dies (issue 9) and sends, in the trailing metadata, `deja-engine-dead: <messages sent>` (the
number of response messages that stream had already sent). The router retries such a stream on
another replica only when nothing of it reached the client: no message relayed by the router and
`<messages sent>` is 0. A stream that has streamed a token is never retried (the client has text
it would otherwise see twice); it fails with the replica's INTERNAL.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

ENGINE_DEAD_KEY = "deja-engine-dead"
"""Trailing metadata key; the value is the number of response messages the stream had sent."""


def engine_dead_trailer(messages_sent: int) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a replica sends with INTERNAL when its engine core died."""
    return ((ENGINE_DEAD_KEY, str(messages_sent)),)


def engine_dead_before_output(trailing: Iterable[Any] | None) -> bool:
    """True when the trailer says the engine core died before the stream sent any message."""
    for item in trailing or ():
        key, value = item[0], item[1]
        if key == ENGINE_DEAD_KEY:
            return str(value) == "0"
    return False
