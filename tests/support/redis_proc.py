"""A throwaway redis-server on a free local port (never the machine's default instance)."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

from clients.testing.redis_server import redis_argv, wait_redis_ready
from service.common.ports import free_port


class RedisProcess:
    """`redis-server --port N --save '' --bind 127.0.0.1`; can be stopped and restarted."""

    def __init__(
        self, port: int | None = None, workdir: Path | None = None, extra: tuple[str, ...] = ()
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.binary = binary
        self.port = port or free_port()
        self.workdir = workdir
        self.extra = extra
        """More server arguments (e.g. "--maxmemory", "1mb")."""
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            redis_argv(self.binary, self.port, self.extra),
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_redis_ready(self.proc, self.port, timeout_s)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing (a slow Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
