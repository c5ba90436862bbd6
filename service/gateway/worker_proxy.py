"""A credential-adding gRPC pass-through in front of one replica, for the SMG gateway.

SMG 1.13 sends no credentials to its gRPC workers (no bearer token; its mTLS flags never reach
its gRPC channel), so a replica started with `--auth-token` refuses it. This proxy listens on
loopback (plaintext: SMG connects with `grpc://127.0.0.1:PORT`) and forwards every method of
`vllm.grpc.engine.VllmEngine` and `grpc.health.v1.Health` to the replica, adding
`authorization: Bearer <token>` (and TLS or mTLS to the replica when given). Messages pass
through as bytes, never parsed; the caller's metadata (`traceparent` included), deadline and
cancellation go upstream, the replica's status, details and metadata come back unchanged. Any
other service is UNIMPLEMENTED here, as on the replica (SMG probes SglangScheduler first).

    DEJA_WORKER_TOKEN=TOKEN python -m service.gateway.worker_proxy --port 7001 \\
        --upstream 127.0.0.1:50051 [--ca-cert CA --client-cert PEM --client-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from smg_grpc_proto.generated import vllm_engine_pb2

log = logging.getLogger("deja.worker_proxy")
SERVICES = (
    vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
)
_HOP_KEYS = ("authorization", "user-agent", "content-type", "te", "host")
"""Metadata that belongs to one hop (or that the proxy sets), not forwarded."""

Metadata = Sequence[tuple[str, str | bytes]]


def _passable(md: Any) -> tuple[tuple[str, str | bytes], ...]:
    return tuple(
        (k, v)
        for k, v in (md or ())
        if not k.startswith((":", "grpc-")) and k.lower() not in _HOP_KEYS
    )


def channel_credentials(
    ca_cert: str | None, client_cert: str | None = None, client_key: str | None = None
) -> grpc.ChannelCredentials | None:
    """TLS to the replica (`ca_cert`: the CA of its certificate), mTLS with a client pair."""
    if ca_cert is None:
        return None
    if (client_cert is None) != (client_key is None):
        raise ValueError("client_cert and client_key go together")
    key = Path(client_key).read_bytes() if client_key else None
    chain = Path(client_cert).read_bytes() if client_cert else None
    return grpc.ssl_channel_credentials(Path(ca_cert).read_bytes(), key, chain)


class WorkerProxy:
    """The handlers: each RPC opens the same method on `channel` with the caller's metadata plus
    the credential, relays messages as bytes and ends as the upstream call ended."""

    def __init__(self, channel: grpc.aio.Channel, token: str | None) -> None:
        self._channel = channel
        self._auth = (("authorization", f"Bearer {token}"),) if token else ()

    def _call_args(self, context: grpc.aio.ServicerContext) -> dict[str, Any]:
        md = _passable(context.invocation_metadata()) + self._auth
        return {"metadata": md, "timeout": context.time_remaining()}

    async def _relay_error(self, context: Any, e: grpc.aio.AioRpcError) -> None:
        await context.abort(e.code(), e.details() or "", _passable(e.trailing_metadata()))

    def unary(self, path: str, client_streaming: bool) -> Callable[..., Any]:
        make = self._channel.stream_unary if client_streaming else self._channel.unary_unary
        method = make(path)  # no serializers: bytes in, bytes out

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> bytes:
            call = method(request, **self._call_args(context))
            try:
                response = await call
                await context.send_initial_metadata(_passable(await call.initial_metadata()))
                context.set_trailing_metadata(_passable(await call.trailing_metadata()))
                return bytes(response)
            except grpc.aio.AioRpcError as e:
                await self._relay_error(context, e)
                raise  # not reached: abort raises
            finally:
                call.cancel()  # no-op once done; a cancelled caller cancels upstream

        return handle

    def streaming(self, path: str, client_streaming: bool) -> Callable[..., Any]:
        make = self._channel.stream_stream if client_streaming else self._channel.unary_stream
        method = make(path)

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            call = method(request, **self._call_args(context))
            try:
                first = True
                async for response in call:
                    if first:
                        await context.send_initial_metadata(
                            _passable(await call.initial_metadata())
                        )
                        first = False
                    yield response
                context.set_trailing_metadata(_passable(await call.trailing_metadata()))
            except grpc.aio.AioRpcError as e:
                await self._relay_error(context, e)
            finally:
                call.cancel()  # the caller went away (task cancelled): upstream is cancelled too

        return handle

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        out = []
        for service in SERVICES:
            methods = {}
            for m in service.methods:
                path = f"/{service.full_name}/{m.name}"
                cs, ss = m.client_streaming, m.server_streaming
                factory = {
                    (False, False): grpc.unary_unary_rpc_method_handler,
                    (False, True): grpc.unary_stream_rpc_method_handler,
                    (True, False): grpc.stream_unary_rpc_method_handler,
                    (True, True): grpc.stream_stream_rpc_method_handler,
                }[(cs, ss)]
                fn = self.streaming(path, cs) if ss else self.unary(path, cs)
                methods[m.name] = factory(fn)  # type: ignore[operator]
            out.append(grpc.method_handlers_generic_handler(service.full_name, methods))
        return out


async def start_proxy(
    upstream: str,
    *,
    token: str | None,
    host: str = "127.0.0.1",
    port: int = 0,
    credentials: grpc.ChannelCredentials | None = None,
) -> tuple[grpc.aio.Server, int, grpc.aio.Channel]:
    """Starts a proxy to `upstream` (HOST:PORT); returns the server, its port and the channel."""
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    if credentials is None:
        channel = grpc.aio.insecure_channel(upstream, options=options)
    else:
        channel = grpc.aio.secure_channel(upstream, credentials, options=options)
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers(WorkerProxy(channel, token).handlers())
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    return server, bound, channel


async def _main(args: argparse.Namespace) -> None:
    creds = channel_credentials(args.ca_cert, args.client_cert, args.client_key)
    token = os.environ.get("DEJA_WORKER_TOKEN") or None
    server, port, channel = await start_proxy(
        args.upstream, token=token, host=args.host, port=args.port, credentials=creds
    )
    log.info("proxying 127.0.0.1:%d -> %s (token %s, tls %s)", port, args.upstream,
             "on" if token else "off", "on" if creds else "off")  # fmt: skip
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(5)
    await channel.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Plain flags: the token alone comes from the environment (DEJA_WORKER_TOKEN, not argv).
    parser.add_argument("--host", default="127.0.0.1", help="Listen address (keep it loopback).")
    parser.add_argument("--port", type=int, default=0, help="Listen port.")
    parser.add_argument("--upstream", required=True, help="The replica, HOST:PORT.")
    parser.add_argument("--ca-cert", help="CA (PEM) of the replica's certificate: TLS to it.")
    parser.add_argument("--client-cert", help="Client certificate (PEM) for a replica with mTLS.")
    parser.add_argument("--client-key", help="Client key (PEM).")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
