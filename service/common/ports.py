"""A free local TCP port for a server that a child process is about to start.

`bind(("127.0.0.1", 0))` and close gives a free port, but the kernel hands out ports from the
same ephemeral range to every outgoing connection (a Redis client, a gRPC channel) and to the next
`bind(0)`: between the pick and the child's own bind, seconds later after loading a model, another
socket can take it, and the child dies with "Failed to bind" (seen in CI). So ports come from just
below the ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), which the kernel never
assigns on its own, and each is handed out once per process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_SPAN = 12_000
"""How many ports below the ephemeral range to draw from."""
_given: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to on `host`, below the ephemeral range, not handed out before by
    this process; an ephemeral one (`bind(0)`) only when none of 200 draws is free."""
    top = _ephemeral_low() - 1
    bottom = max(1024, top - _SPAN)
    with _lock:
        if top - bottom >= 100:
            for _ in range(200):
                port = _rng.randint(bottom, top)
                if port not in _given and _bindable(host, port):
                    _given.add(port)
                    return port
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        _given.add(port)
        return port
