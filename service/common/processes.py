"""Stopping a child process the way deja's servers expect: SIGTERM (they drain), then SIGKILL."""

from __future__ import annotations

import signal
import subprocess


def stop_gracefully(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; waits for it either way."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
