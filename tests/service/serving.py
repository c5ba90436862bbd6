"""A real `deja serve` subprocess for the tests that signal or kill it (SIGTERM drain, crash
isolation of the engine core): start it, wait until it serves, find its engine core, and kill
both on the way out whatever the test did."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.common.ports import free_port
from service.common.rpc import SERVICE_NAME
from tests.support.waiting import wait_until_sync

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    target: str
    log: Path
    core: int


def start_serve(model: Path, port: int, grace: float, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "service.cli", "serve",
        "--model", str(model), "--port", str(port), "--grace-period", str(grace),
        "--num-device-blocks", "256", "--max-model-len", "1024", "--cpu-swap-gib", "0",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    root = Path(__file__).resolve().parents[2]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT)


def health(target: str, timeout: float = 1.0) -> int | None:
    """The replica's health status for deja.v1.Inference, or None when it does not answer."""
    try:
        with grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout
            )
            return int(resp.status)
    except grpc.RpcError:
        return None


def wait_serving(proc: subprocess.Popen[bytes], target: str, log: Path) -> None:
    def up() -> bool:
        assert proc.poll() is None, f"deja serve exited:\n{log.read_text()}"
        return health(target) == SERVING

    assert wait_until_sync(up, 180, interval=0.2), f"deja serve did not start:\n{log.read_text()}"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def core_of(pid: int) -> int:
    """The engine-core child of a `deja serve` process (not multiprocessing's resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    cores = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                cores.append(child)
    assert len(cores) == 1, f"expected one engine core among {children}"
    return cores[0]


@contextlib.contextmanager
def serving(model: Path, tmp_path: Path, grace: float) -> Iterator[Served]:
    """A healthy `deja serve` subprocess and its engine core; both are killed on the way out."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    proc = start_serve(model, port, grace, log)
    core = None
    try:
        wait_serving(proc, target, log)
        core = core_of(proc.pid)
        yield Served(proc, target, log, core)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if core is not None and alive(core):
            os.kill(core, signal.SIGKILL)


def one_token_completion(port: int, model: str, api_key: str) -> int:
    """The HTTP status of a one-token completion through an SMG gateway on `port`.

    NOTE: SMG lists the model before it has loaded the tokenizer and answers 503 "retry shortly"
    meanwhile; a gateway fixture is ready only once this answers 200.
    """
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0
