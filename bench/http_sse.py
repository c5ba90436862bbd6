"""A minimal asyncio HTTP/1.1 client for OpenAI-style streaming (server-sent events).

    client = SseClient("127.0.0.1", 8000)
    async for event in client.post("/v1/chat/completions", {"model": m, "stream": True, ...}):
        ...  # each `data:` payload as parsed JSON, until `data: [DONE]`
    await client.close()

Standard library only (no httpx, no pydantic models): the benchmarks measure the gateway, so the
client adds as little per-chunk work as a client can (one `json.loads` per event). Connections
are kept alive and reused, one per request in flight, like a pooled HTTP client's; a response
read to its end hands its connection back, an abandoned one closes it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.served import MessagesOf

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def greedy_chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A streamed `/v1/chat/completions` request, greedy, exactly `max_tokens` tokens (EOS
    ignored: SMG passes `ignore_eos` on to the engine), usage in the last event."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class ChatStream:
    """Token-id prompts streamed through an OpenAI-style `/v1/chat/completions` (greedy, exactly
    `output_len` tokens): what the chat backends of the benchmarks share."""

    def __init__(self, client: SseClient, model: str, messages_of: MessagesOf) -> None:
        self.client = client
        self.model = model
        self.messages_of = messages_of

    def events(self, prompt: list[int], output_len: int) -> AsyncIterator[dict[str, Any]]:
        body = greedy_chat_body(self.model, self.messages_of(prompt), output_len)
        return self.client.post("/v1/chat/completions", body)


class HttpError(RuntimeError):
    """A non-200 answer: its status and body."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


class SseClient:
    def __init__(self, host: str, port: int, api_key: str | None = None) -> None:
        self.host = host
        self.port = port
        self.api_key = api_key
        self._idle: list[_Conn] = []

    async def post(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POSTs `body` as JSON and yields each event's parsed `data:` payload."""
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            + (f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else "")
            + f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        conn, status, headers = await self._send(head + data)
        done = False
        try:
            reader = conn[0]
            if status != 200:
                raise HttpError(
                    status, (await _read_body(reader, headers)).decode(errors="replace")
                )
            if headers.get("transfer-encoding") != "chunked":
                raise HttpError(status, "expected a chunked event stream")
            buf = b""
            async for piece in _chunks(reader):
                buf += piece
                # NOTE: one event may span chunks, and one chunk may hold several events.
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload != b"[DONE]":
                            yield json.loads(payload)
            done = True
        finally:
            if done and headers.get("connection", "keep-alive") != "close":
                self._idle.append(conn)
            else:
                conn[1].close()

    async def _send(self, request: bytes) -> tuple[_Conn, int, dict[str, str]]:
        """Writes `request` on an idle connection (a new one if none, or if the idle one was
        closed by the server meanwhile); returns it with the status and the headers."""
        while True:
            reused = bool(self._idle)
            conn = (
                self._idle.pop() if reused else await asyncio.open_connection(self.host, self.port)
            )
            reader, writer = conn
            try:
                writer.write(request)
                await writer.drain()
                status_line = await reader.readline()
            except ConnectionError:
                status_line = b""
            if status_line:
                break
            writer.close()
            if not reused:
                raise ConnectionError(f"{self.host}:{self.port} closed the connection")
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip().lower()
        return conn, status, headers

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The pieces of a chunked body, up to its last (empty) chunk and trailer."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            return
        piece = await reader.readexactly(size + 2)  # the chunk and its CRLF
        yield piece[:-2]


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding") == "chunked":
        return b"".join([p async for p in _chunks(reader)])
    return await reader.readexactly(int(headers.get("content-length", "0")))
