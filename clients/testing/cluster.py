"""Local deja processes for benchmarks and tests: replicas and routers, one or a cluster.

    group = ProcessGroup(workdir)
    group.spawn("r0", serve_argv(model, port=p0, replica_id="r0", redis_url=url))
    group.spawn("router", route_argv(port=p, replicas=[...], policy="affinity"))
    wait_healthy(group, "r0", f"127.0.0.1:{p0}")
    ...
    group.stop_all()

    # one replica, healthy for the with-block, drained after it
    with serving(workdir, "serve", serve_argv(model, port=p, replica_id="a"), target) as group:
        ...

Every process logs to `workdir/<name>.log`; a process that exits while being waited for raises
with the tail of its log.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from clients.health import wait_serving
from clients.testing.polling import poll_until
from service.common.processes import stop_gracefully


def deja_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "service.cli", *args]


def serve_argv(
    model: str,
    *,
    port: int,
    replica_id: str,
    redis_url: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    argv = deja_argv(
        "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
        "--replica-id", replica_id, "--device", "cpu", "--no-reflection",
    )  # fmt: skip
    if redis_url:
        argv += ["--redis-url", redis_url]
    return [*argv, *extra]


def route_argv(
    *,
    port: int,
    replicas: Sequence[str] = (),
    redis_url: str | None = None,
    policy: str = "affinity",
    model: str | None = None,
    metrics_port: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    argv = deja_argv("route", "--host", "127.0.0.1", "--port", str(port), "--policy", policy)
    if replicas:
        argv += ["--replicas", ",".join(replicas)]
    if redis_url:
        argv += ["--redis-url", redis_url]
    if model:
        argv += ["--model", model]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    return [*argv, *extra]


class ProcessGroup:
    """Processes started with the environment plus HF offline mode, unbuffered output and
    `omp_threads` (OMP_NUM_THREADS: torch's intra-op threads; None: the environment's), then
    `env`."""

    def __init__(
        self, workdir: Path, env: dict[str, str] | None = None, *, omp_threads: int | None = 1
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        omp = {"OMP_NUM_THREADS": str(omp_threads)} if omp_threads is not None else {}
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **omp,
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.argvs: dict[str, list[str]] = {}

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def tail(self, name: str, n: int = 30) -> str:
        path = self.log_path(name)
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        if name in self.procs and self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is already running")
        with open(self.log_path(name), "ab") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=os.getcwd()
            )
        self.procs[name] = proc
        self.argvs[name] = argv
        return proc

    def respawn(self, name: str) -> subprocess.Popen[bytes]:
        return self.spawn(name, self.argvs[name])

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def check_alive(self, name: str) -> None:
        if not self.alive(name):
            code = self.procs[name].returncode if name in self.procs else None
            raise RuntimeError(f"{name} exited ({code}):\n{self.tail(name)}")

    def kill(self, name: str) -> None:
        """SIGKILL: the process gets no chance to drain (a crash)."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    def stop(self, name: str, timeout_s: float = 30.0) -> None:
        """SIGTERM (drain), then SIGKILL after `timeout_s`."""
        proc = self.procs.get(name)
        if proc is not None:
            stop_gracefully(proc, timeout_s)

    def stop_all(self, timeout_s: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def wait_healthy(group: ProcessGroup, name: str, target: str, timeout_s: float = 120.0) -> None:
    """Waits until `target` answers the gRPC health check with SERVING."""
    wait_serving(
        target,
        timeout_s,
        name=name,
        check_alive=lambda: group.check_alive(name),
        log_tail=lambda: group.tail(name),
        poll_s=0.25,
    )


@contextmanager
def serving(
    workdir: Path,
    name: str,
    argv: list[str],
    target: str,
    timeout_s: float,
    *,
    omp_threads: int | None = None,
    drain_s: float = 60.0,
) -> Iterator[ProcessGroup]:
    """`argv` (a `deja serve`) started as `name`, healthy at `target` for the with-block (its
    group holds it: `group.procs[name]`); then SIGTERM (drain), SIGKILL after `drain_s`."""
    group = ProcessGroup(workdir, omp_threads=omp_threads)
    print(
        f"starting {name}: {shlex.join(argv[1:])} (log {group.log_path(name)})",
        file=sys.stderr,
        flush=True,
    )
    group.spawn(name, argv)
    try:
        t0 = time.monotonic()
        wait_healthy(group, name, target, timeout_s)
        print(f"{name} ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        yield group
    finally:
        group.stop(name, drain_s)


def scrape(metrics_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample (`labels` as written, e.g. 'state="healthy"'); 0 if absent."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    m = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def metric_sum(text: str, name: str) -> float:
    """The sum of a metric's samples over all its label values; 0 if absent."""
    pattern = r"^" + re.escape(name) + r"(?:\{[^}]*\})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def wait_router_replicas(
    group: ProcessGroup, name: str, metrics_port: int, n: int, timeout_s: float = 60.0
) -> None:
    """Waits until the router counts `n` healthy replicas."""
    poll_until(
        lambda: metric_value(scrape(metrics_port), "deja_router_replicas", 'state="healthy"') >= n,
        timeout_s,
        0.25,
        check_alive=lambda: group.check_alive(name),
        timeout_error=lambda: TimeoutError(
            f"{name} sees fewer than {n} healthy replicas:\n{group.tail(name)}"
        ),
    )


def engine_busy_seconds(metrics_ports: Sequence[int], timeout_s: float = 10.0) -> float:
    """The replicas' `deja_engine_busy_seconds` summed (wall seconds their engines spent in
    steps), once the engines are idle and the counters have settled (each replica refreshes its
    engine metrics every 0.5 s); 0.0 if they never settle or one cannot be read."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            texts = [scrape(p) for p in metrics_ports]
        except OSError:
            return 0.0
        busy = sum(metric_sum(t, "deja_engine_busy_seconds_total") for t in texts)
        idle = all(metric_sum(t, "deja_num_requests_running") == 0 for t in texts)
        if idle and busy == last:
            return busy
        last = busy if idle else None
        time.sleep(0.6)
    return 0.0
