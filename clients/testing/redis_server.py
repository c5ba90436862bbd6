"""A throwaway redis-server on a free local port for benchmarks (the real server, from Debian)."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from clients.testing.polling import poll_until
from service.common.ports import free_port


@contextmanager
def redis_server(extra: Sequence[str] = (), timeout_s: float = 10.0) -> Iterator[str]:
    """`redis-server --port N --save '' --bind 127.0.0.1 *extra` for the with-block, which gets
    its URL; killed after it."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    argv = redis_argv(binary, port, extra)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_redis_ready(proc, port, timeout_s)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def redis_argv(binary: str, port: int, extra: Sequence[str] = ()) -> list[str]:
    """A redis-server on 127.0.0.1:`port` that keeps nothing on disk, with `extra` arguments."""
    argv = [binary, "--port", str(port), "--save", "", "--appendonly", "no"]
    return [*argv, "--bind", "127.0.0.1", *extra]


def wait_redis_ready(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> None:
    """Returns once the redis-server `proc` on `port` answers PING; RuntimeError if it exits or
    does not answer within `timeout_s`."""

    def pongs() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")

    def check_alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")

    poll_until(
        pongs,
        timeout_s,
        0.05,
        check_alive=check_alive,
        timeout_error=lambda: RuntimeError("redis-server did not start"),
    )
