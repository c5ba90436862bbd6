"""Python client of the deja.v1 API, sync (`DejaClient`) and asyncio (`AsyncDejaClient`).

    with DejaClient("localhost:50051") as client:
        for delta in client.generate("Hello", max_tokens=32, temperature=0):
            print(delta.choices[0].text if delta.choices else "", end="")
        result = client.complete(messages=[{"role": "user", "content": "Hi"}])

`generate` streams GenerateResponse messages; `complete` collects them into a GenerateResult.
Both take a deadline (`timeout`, seconds), retry on UNAVAILABLE only before the first message
(nothing was generated yet), inject the W3C trace context of a client span into the call
metadata, and send `authorization: Bearer <token>` when a token is set. Leaving the stream early
cancels the call (the server aborts the request and frees its blocks).

This module holds `DejaClient` and the command-line connection helpers, and re-exports the rest:
`AsyncDejaClient` (clients/async_client.py), `build_request` (clients/request.py) and
`GenerateResult` (clients/result.py); what both clients share is in clients/base.py.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Generator, Sequence
from typing import Any

import grpc

from clients.async_client import AsyncDejaClient
from clients.base import DEFAULT_TARGET, ClientBase
from clients.request import build_request, tokenize_request
from clients.result import GenerateResult, collector
from service.api.deja.v1 import inference_pb2 as pb
from service.common.flags import add_bool_flag, add_flag


class DejaClient(ClientBase):
    """Blocking client; one channel per instance (close it, or use `with`)."""

    _channel: grpc.Channel

    def _open_channel(self, target: str, creds: grpc.ChannelCredentials | None) -> grpc.Channel:
        if creds is not None:
            return grpc.secure_channel(target, creds)
        return grpc.insecure_channel(target)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DejaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 10.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Generator[pb.GenerateResponse, None, None]:
        """Streams the response messages (see build_request for the arguments)."""
        return self.stream(build_request(prompt, **kwargs), timeout=timeout)

    def stream(
        self, req: pb.GenerateRequest, *, timeout: float | None = None
    ) -> Generator[pb.GenerateResponse, None, None]:
        with self._generate_call(req, timeout) as gen:
            while True:
                call = self._attempt(req, gen)
                try:
                    first = next(call)
                    break
                except StopIteration:
                    return
                except grpc.RpcError as e:
                    wait = self._retry_wait(e, gen)
                    if wait is None:
                        raise
                    time.sleep(wait)
            gen.add(first)
            yield first
            for msg in call:
                gen.add(msg)
                yield msg

    def complete(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> GenerateResult:
        """Runs one request to the end and returns it collected (`.parse()` reads JSON output)."""
        result, add = collector(kwargs)
        for msg in self.generate(prompt, timeout=timeout, **kwargs):
            add(msg)
        return result

    def tokenize(
        self, text: str | None = None, *, messages: Sequence[dict[str, str]] | None = None
    ) -> list[int]:
        resp = self._unary(self.stub.Tokenize, tokenize_request(text, messages))
        return list(resp.token_ids)

    def model_info(self) -> pb.ModelInfo:
        return self._unary(self.stub.GetModelInfo, pb.GetModelInfoRequest())

    def load(self) -> pb.Load:
        return self._unary(self.stub.GetLoad, pb.GetLoadRequest())

    def cache_stats(self) -> pb.CacheStats:
        return self._unary(self.stub.GetCacheStats, pb.GetCacheStatsRequest())

    def abort(self, *request_ids: str) -> list[str]:
        resp = self._unary(self.stub.Abort, pb.AbortRequest(request_ids=request_ids))
        return list(resp.aborted)


# -- command-line helpers ------------------------------------------------------------------------


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """--target, --token, --tls, --tls-ca, --timeout (each also a DEJA_* variable)."""
    g = parser.add_argument_group("connection")
    add_flag(g, "--target", default=DEFAULT_TARGET, help="Server address host:port.")
    add_flag(g, "--token", help="Bearer token (when the server has auth on).")
    add_bool_flag(g, "--tls", default=False, help="Connect with TLS.")
    add_flag(g, "--tls-ca", help="PEM root certificates for TLS (default: system roots).")
    add_flag(g, "--timeout", type=float, help="Deadline per call in seconds.")


def client_from_args(args: argparse.Namespace) -> DejaClient:
    roots = None
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            roots = f.read()
    return DejaClient(
        args.target, token=args.token, tls=args.tls, root_certificates=roots, timeout=args.timeout
    )


__all__ = [
    "AsyncDejaClient",
    "DejaClient",
    "GenerateResult",
    "build_request",
]
