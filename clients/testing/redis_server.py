"""A throwaway redis-server on a free local port for benchmarks (the real server, from Debian)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from service.common.ports import free_port


@contextmanager
def redis_server(extra: Sequence[str] = (), timeout_s: float = 10.0) -> Iterator[str]:
    """`redis-server --port N --save '' --bind 127.0.0.1 *extra` for the with-block, which gets
    its URL; killed after it."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    argv = [binary, "--port", str(port), "--save", "", "--appendonly", "no"]
    argv += ["--bind", "127.0.0.1", *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=10)
