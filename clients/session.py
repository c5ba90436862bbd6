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


class _History:
    def __init__(self, system: str | None, session_id: str | None, sampling: dict[str, Any]):
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


class ChatSession(_History):
    """A conversation over a DejaClient; `sampling` are defaults for every turn."""

    def __init__(
        self,
        client: DejaClient,
        *,
        system: str | None = None,
        session_id: str | None = None,
        **sampling: Any,
    ) -> None:
        super().__init__(system, session_id, sampling)
        self.client = client

    def send(self, content: str, **overrides: Any) -> Iterator[str]:
        """Streams the answer's text deltas; the turn joins the history once it completes."""
        from clients.client import GenerateResult

        kwargs = self._request(content, overrides)
        result = GenerateResult()
        t0 = time.monotonic()
        completed = False
        try:
            for msg in self.client.generate(**kwargs):
                result.add(msg, elapsed_s=time.monotonic() - t0)
                for d in msg.choices:
                    if d.index == 0 and d.text:
                        yield d.text
            completed = result.final is not None
        finally:
            self._finish(result, completed)

    def ask(self, content: str, **overrides: Any) -> str:
        """One whole turn; returns the answer."""
        return "".join(self.send(content, **overrides))


class AsyncChatSession(_History):
    """A conversation over an AsyncDejaClient."""

    def __init__(
        self,
        client: AsyncDejaClient,
        *,
        system: str | None = None,
        session_id: str | None = None,
        **sampling: Any,
    ) -> None:
        super().__init__(system, session_id, sampling)
        self.client = client

    async def send(self, content: str, **overrides: Any) -> AsyncIterator[str]:
        from clients.client import GenerateResult

        kwargs = self._request(content, overrides)
        result = GenerateResult()
        t0 = time.monotonic()
        completed = False
        try:
            async for msg in self.client.generate(**kwargs):
                result.add(msg, elapsed_s=time.monotonic() - t0)
                for d in msg.choices:
                    if d.index == 0 and d.text:
                        yield d.text
            completed = result.final is not None
        finally:
            self._finish(result, completed)

    async def ask(self, content: str, **overrides: Any) -> str:
        return "".join([piece async for piece in self.send(content, **overrides)])
