"""Waiting for a freshly started server: polls the standard gRPC health check."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_serving(
    target: str,
    timeout_s: float,
    *,
    name: str,
    check_alive: Callable[[], None],
    log_tail: Callable[[], str],
    poll_s: float,
) -> None:
    """Returns once `target` answers the health check with SERVING.

    `check_alive` raises when the server's process has died; after `timeout_s` a TimeoutError
    names the server (`name`) and quotes the end of its log (`log_tail()`).
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            check_alive()
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not healthy after {timeout_s} s:\n{log_tail()}")
            time.sleep(poll_s)
