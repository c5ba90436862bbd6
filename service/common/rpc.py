"""gRPC helpers shared by the replica and the router."""

from __future__ import annotations

from typing import NoReturn

import grpc

from service.api.deja.v1 import inference_pb2 as pb

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Inference"].full_name
"""`deja.v1.Inference`: the name health, reflection and the handlers are registered under."""


async def abort(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    detail: str,
    trailer: tuple[tuple[str, str], ...] = (),
) -> NoReturn:
    """Ends the call with `code`, `detail` and trailing metadata `trailer` (`context.abort`
    raises; this says so to mypy)."""
    await context.abort(code, detail, trailer)
    raise AssertionError("unreachable")
