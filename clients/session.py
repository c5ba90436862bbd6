"""Multi-turn chat over the deja client: the history and a session id kept across turns.

    session = ChatSession(client, system="You are terse.", max_tokens=128)
    for piece in session.send("What is the capital of France?"):
        print(piece, end="", flush=True)
    session.ask("And of Italy?")  # -> the whole answer

Every turn sends the full history as chat messages with the same `session_id`, so a router keeps
the conversation on one replica and the replica's prefix cache serves the earlier turns.
A turn left early (or failed) is dropped from the history.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clients.client import AsyncDejaClient, DejaClient, GenerateResult
    from service.api.deja.v1 import inference_pb2 as pb


class _History:
    """What both sessions keep: the client, the messages so far, the session id, the defaults."""

    def __init__(
        self,
        client: Any,
        *,
        system: str | None = None,
        session_id: str | None = None,
        **sampling: Any,
    ) -> None:
        self.client = client
        self.system = system
        self.session_id = session_id or uuid.uuid4().hex
        self.sampling = sampling
        self.messages: list[dict[str, str]] = []
        self.last_result: GenerateResult | None = None
        """The collected result of the last completed turn (usage, timings)."""
        self._clear()

    def _clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.last_result = None

    def reset(self) -> None:
        """Forgets the conversation (keeps the system prompt) and starts a new session id."""
        self._clear()
        self.session_id = uuid.uuid4().hex

    def _request(self, content: str, overrides: dict[str, Any]) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": content})
        return {
            "messages": list(self.messages),
            "session_id": self.session_id,
            **self.sampling,
            **overrides,
        }

    def _finish(self, result: GenerateResult, completed: bool) -> None:
        if completed:
            self.messages.append({"role": "assistant", "content": result.text})
            self.last_result = result
        else:
            self.messages.pop()


class _Turn:
    """One turn's answer as it streams in."""

    def __init__(self) -> None:
        from clients.client import GenerateResult

        self.result = GenerateResult()
        self.t0 = time.monotonic()

    def add(self, msg: pb.GenerateResponse) -> list[str]:
        """Collects a response message; returns its text deltas of the first choice."""
        self.result.add(msg, elapsed_s=time.monotonic() - self.t0)
        return [d.text for d in msg.choices if d.index == 0 and d.text]


class ChatSession(_History):
    """A conversation over a DejaClient; `sampling` are defaults for every turn."""

    client: DejaClient

    def send(self, content: str, **overrides: Any) -> Iterator[str]:
        """Streams the answer's text deltas; the turn joins the history once it completes."""
        kwargs = self._request(content, overrides)
        turn = _Turn()
        completed = False
        try:
            for msg in self.client.generate(**kwargs):
                yield from turn.add(msg)
            completed = turn.result.final is not None
        finally:
            self._finish(turn.result, completed)

    def ask(self, content: str, **overrides: Any) -> str:
        """One whole turn; returns the answer."""
        return "".join(self.send(content, **overrides))


class AsyncChatSession(_History):
    """A conversation over an AsyncDejaClient."""

    client: AsyncDejaClient

    async def send(self, content: str, **overrides: Any) -> AsyncIterator[str]:
        kwargs = self._request(content, overrides)
        turn = _Turn()
        completed = False
        try:
            async for msg in self.client.generate(**kwargs):
                for text in turn.add(msg):
                    yield text
            completed = turn.result.final is not None
        finally:
            self._finish(turn.result, completed)

    async def ask(self, content: str, **overrides: Any) -> str:
        return "".join([piece async for piece in self.send(content, **overrides)])
