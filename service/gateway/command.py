"""`deja gateway`: an OpenAI-compatible HTTP front door (the SMG gateway) over deja replicas.

    deja gateway                                   # demo model: 1 replica + SMG on 127.0.0.1:8000
    deja gateway --replicas 2 --model /path/to/hf-folder
    deja gateway --worker-url grpc://10.0.0.5:50051 --worker-url grpc://10.0.0.6:50051 \\
        --model /path/to/hf-folder                 # replicas started elsewhere (`deja serve`)

Like `sglang_router.launch_server`, it starts the replicas too (`--replicas N`, each a
`deja serve` on a free local port, `--serve-arg` passed to each) unless `--worker-url` names
running ones; then it runs `smg launch` (PyPI `smg`) in front of them with cache-aware routing.
The gateway speaks `vllm.grpc.engine.VllmEngine` to the replicas (served beside deja.v1 on the
same port) and OpenAI's `/v1/chat/completions`, `/v1/completions` and `/v1/models` to callers;
it applies the chat template and tokenizes with the tokenizer in `--model`'s folder. `--api-key`
makes HTTP callers present `Authorization: Bearer KEY`.

SMG 1.13 sends no credentials to gRPC workers, so `--worker-token TOKEN` puts a credential-adding
proxy (service/gateway/worker_proxy.py, one process per replica on a loopback port) between SMG
and each replica; it adds `authorization: Bearer TOKEN`. Replicas started here then require it
(`deja serve --auth-token TOKEN:gateway`, passed in their environment); `--worker-url` ones must
have been started with it. `--worker-ca` (with `grpcs://` URLs) makes the proxies speak TLS to
the replicas, `--worker-cert`/`--worker-key` mTLS (`deja serve --tls-client-ca`). On
SIGTERM/SIGINT the gateway stops first, then the proxies, then the replicas drain; if any child
dies, everything stops and the command exits 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from service.common.engine_args import DEFAULT_CACHE_DIR
from service.common.flags import add_flag, add_list_flag
from service.common.ports import free_port
from service.common.processes import stop_gracefully

log = logging.getLogger("deja.gateway")
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load", "prefix_hash")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--host", default="127.0.0.1", help="HTTP address of the gateway.")
    add_flag(parser, "--port", type=int, default=8000, help="HTTP port of the gateway.")
    add_flag(parser, "--metrics-host", default="127.0.0.1", help="Prometheus address of SMG.")
    add_flag(parser, "--metrics-port", type=int, default=29000, help="Prometheus port of SMG.")
    add_flag(
        parser,
        "--model",
        default="demo",  # SMG reads a folder's tokenizer: the converted demo, not its GGUF file
        help='Checkpoint folder or "demo".',
    )
    add_flag(parser, "--cache-dir", default=DEFAULT_CACHE_DIR, help="Where converted models live.")
    add_list_flag(
        parser,
        "--worker-url",
        metavar="grpc://HOST:PORT",
        help="A running replica; none: start --replicas of them here",
    )
    add_flag(parser, "--replicas", type=int, default=1, help="Replicas to start (no --worker-url).")
    add_list_flag(parser, "--serve-arg", help="An argument for each started `deja serve`")
    add_flag(parser, "--policy", default="cache_aware", choices=POLICIES, help="SMG's routing.")
    add_flag(parser, "--api-key", default=None, help="Key HTTP callers must present (Bearer).")
    add_list_flag(parser, "--smg-arg", help="An extra argument for `smg launch`")
    w = parser.add_argument_group("credentials for the replicas (added by a proxy per replica)")
    add_flag(w, "--worker-token", help="Bearer token the replicas require (TOKEN, no ':' or ',').")
    add_flag(w, "--worker-ca", help="CA (PEM) of the replicas' certificates (grpcs:// URLs).")
    add_flag(w, "--worker-cert", help="Client certificate (PEM) for replicas requiring mTLS.")
    add_flag(w, "--worker-key", help="Client key (PEM) for --worker-cert.")
    add_flag(parser, "--startup-timeout", type=float, default=600.0, help="Seconds to wait.")
    add_flag(parser, "--log-level", default="info", choices=("debug", "info", "warning", "error"))


def smg_binary() -> str:
    """The `smg` executable beside this Python (the venv's), else on PATH."""
    beside = Path(sys.executable).parent / "smg"
    found = str(beside) if beside.exists() else shutil.which("smg")
    if found is None:
        raise FileNotFoundError("the `smg` command is not installed: pip install smg==1.13.0")
    return found


def smg_command(args: argparse.Namespace, model_path: str, worker_urls: list[str]) -> list[str]:
    cmd = [
        smg_binary(), "launch", "--host", args.host, "--port", str(args.port),
        "--prometheus-host", args.metrics_host, "--prometheus-port", str(args.metrics_port),
        "--policy", args.policy, "--model-path", model_path,
        "--worker-urls", *worker_urls,
    ]  # fmt: skip
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd + [a for extra in args.smg_arg for a in shlex.split(extra)]


def proxied(args: argparse.Namespace) -> bool:
    """Whether the replicas need a credential-adding proxy in front of them."""
    return bool(args.worker_token or args.worker_ca)


def credential_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the replica-credential flags, or None."""
    token = args.worker_token
    if token and any(c in token for c in ":, \t\n"):  # empty: no token (DEJA_WORKER_TOKEN=)
        return "--worker-token must not hold ':', ',' or whitespace"
    if (args.worker_cert is None) != (args.worker_key is None):
        return "--worker-cert and --worker-key go together"
    if args.worker_cert and not args.worker_ca:
        return "--worker-cert needs --worker-ca (mTLS is TLS)"
    schemes = {u.partition("://")[0] for u in args.worker_url}
    if not schemes <= {"grpc", "grpcs"}:
        return "--worker-url must be grpc://HOST:PORT or grpcs://HOST:PORT"
    if ("grpcs" in schemes) != bool(args.worker_ca):
        return "grpcs:// worker URLs and --worker-ca go together (the proxies speak TLS)"
    return None


def proxy_command(args: argparse.Namespace, port: int, upstream: str) -> list[str]:
    cmd = [sys.executable, "-m", "service.gateway.worker_proxy",
           "--port", str(port), "--upstream", upstream]  # fmt: skip
    if args.worker_ca:
        cmd += ["--ca-cert", args.worker_ca]
    if args.worker_cert:
        cmd += ["--client-cert", args.worker_cert, "--client-key", args.worker_key]
    return cmd


def serve_command(model_path: str, port: int, extra: list[str]) -> list[str]:
    args = [a for e in extra for a in shlex.split(e)]
    return [sys.executable, "-m", "service.cli", "serve", "--model", model_path,
            "--host", "127.0.0.1", "--port", str(port), *args]  # fmt: skip


def _serving(target: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
    except grpc.RpcError:
        return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


class Children:
    """The processes this command started, stopped in reverse order on the way out."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        self, name: str, cmd: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log.info("starting %s: %s", name, shlex.join(cmd))
        proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        self.procs.append((name, proc))
        return proc

    def dead(self) -> str | None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                return f"{name} exited with status {proc.returncode}"
        return None

    def stop(self, timeout_s: float = 30.0) -> None:
        for _name, proc in reversed(self.procs):
            stop_gracefully(proc, timeout_s)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    from engine.demo import resolve_model_path

    try:
        model_path = resolve_model_path(args.model, Path(args.cache_dir).expanduser())
        smg_binary()
        if why := credential_error(args):
            raise ValueError(why)
    except (ValueError, FileNotFoundError) as e:
        print(f"deja gateway: error: {e}", file=sys.stderr)
        return 2
    if not args.worker_url and args.replicas < 1:
        print(
            "deja gateway: error: --replicas must be >= 1 (or give --worker-url)", file=sys.stderr
        )
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    children = Children()
    try:
        return _run(args, model_path, children, stop)
    finally:
        children.stop()
        log.info("stopped")


def _run(
    args: argparse.Namespace, model_path: str, children: Children, stop: threading.Event
) -> int:
    upstreams = [u.partition("://")[2] for u in args.worker_url]
    if not upstreams:
        env = {"DEJA_AUTH_TOKEN": f"{args.worker_token}:gateway"} if args.worker_token else {}
        for i in range(args.replicas):
            port = free_port()
            cmd = serve_command(model_path, port, args.serve_arg)
            children.start(f"replica {i}", cmd, env)
            upstreams.append(f"127.0.0.1:{port}")
        if not _wait(args, children, stop, "replicas", set(upstreams), _serving):
            return 0 if stop.is_set() else 1
    if proxied(args):
        env = {"DEJA_WORKER_TOKEN": args.worker_token} if args.worker_token else {}
        proxies = []
        for i, upstream in enumerate(upstreams):
            port = free_port()
            children.start(f"proxy {i}", proxy_command(args, port, upstream), env)
            proxies.append(f"127.0.0.1:{port}")
        if not _wait(args, children, stop, "proxies", set(proxies), _listening):
            return 0 if stop.is_set() else 1
        urls = [f"grpc://{p}" for p in proxies]
    else:
        urls = list(args.worker_url) or [f"grpc://{t}" for t in upstreams]
    children.start("smg", smg_command(args, model_path, urls))
    log.info("OpenAI API on http://%s:%d/v1 over %s", args.host, args.port, " ".join(urls))
    while not stop.wait(0.2):
        if why := children.dead():
            print(f"deja gateway: error: {why}; stopping", file=sys.stderr)
            return 1
    log.info("signal received; stopping the gateway, then the replicas")
    return 0


def _listening(target: str) -> bool:
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


def _wait(
    args: argparse.Namespace,
    children: Children,
    stop: threading.Event,
    what: str,
    pending: set[str],
    ready: Callable[[str], bool],
) -> bool:
    """Waits until `ready` holds for every target; False on a signal, a dead child or timeout."""
    deadline = time.monotonic() + args.startup_timeout
    while pending:
        if stop.is_set():
            return False
        if (why := children.dead()) or time.monotonic() > deadline:
            print(f"deja gateway: error: {why or f'{what} did not start in time'}", file=sys.stderr)
            return False
        pending = {t for t in pending if not ready(t)}
        time.sleep(0.2)
    return True
