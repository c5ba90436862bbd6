"""`deja gateway --worker-token` (an unauthenticated caller is rejected
when the replica requires a token): the gateway starts one replica on the demo model that
requires the token, a credential-adding proxy in front of it and the real `smg` in front of that.
OpenAI calls through SMG work; the replica refuses a direct caller without the token; an HTTP
caller without the gateway's key gets 401."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from openai import AuthenticationError, OpenAI
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from clients.client import DejaClient
from service.common.ports import free_port
from service.common.processes import stop_gracefully
from tests.service.serving import one_token_completion
from tests.support.waiting import wait_until_sync

pytestmark = pytest.mark.slow

API_KEY, WORKER_TOKEN = "gateway-key", "replica-secret"
MODEL = "smollm2-135m-instruct"
QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    port: int
    replica: str
    """The replica's own gRPC address (HOST:PORT), read from the gateway's log."""
    log: Path
    """The gateway's output, its children's included."""

    def openai(self, api_key: str = API_KEY) -> OpenAI:
        url = f"http://127.0.0.1:{self.port}/v1"
        return OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=120)


def _models(port: int) -> bool:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200 and MODEL in r.read().decode()
    except OSError:  # HTTPError included
        return False


@pytest.fixture(scope="module")
def gateway(demo_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    log = tmp_path_factory.mktemp("gateway-token") / "gateway.log"
    port = free_port()
    cmd = [
        sys.executable, "-m", "service.cli", "gateway", "--model", str(demo_model_path),
        "--port", str(port), "--metrics-port", str(free_port()), "--api-key", API_KEY,
        "--worker-token", WORKER_TOKEN, "--replicas", "1",
        "--serve-arg", "--num-device-blocks 128 --max-model-len 1024 --cpu-swap-gib 0",
    ]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"deja gateway exited:\n{log.read_text()}"
            return _models(port) and one_token_completion(port, MODEL, API_KEY) == 200

        assert wait_until_sync(ready, 180, interval=0.3), log.read_text()[-4000:]
        text = log.read_text()
        found = re.search(r"starting replica 0: .* --port (\d+)", text)
        assert found and WORKER_TOKEN not in text, text[-4000:]  # never on a command line
        yield Gateway(proc, port, f"127.0.0.1:{found.group(1)}", log)
    finally:
        stop_gracefully(proc, 60)


def test_chat_through_smg_reaches_the_token_replica(gateway: Gateway) -> None:
    out = gateway.openai().chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=24
    )
    assert "Paris" in (out.choices[0].message.content or "")


def test_the_replica_refuses_callers_without_the_token(gateway: Gateway) -> None:
    with DejaClient(gateway.replica, retries=0) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.complete("Hello", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    with grpc.insecure_channel(gateway.replica) as ch:
        stub = vpb_grpc.VllmEngineStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    with DejaClient(gateway.replica, token=WORKER_TOKEN, retries=0) as client:
        assert client.complete("Hello", max_tokens=2)  # the token is what the replica wants


def test_http_caller_without_the_key_gets_401(gateway: Gateway) -> None:
    with pytest.raises(AuthenticationError) as err:
        gateway.openai(api_key="wrong").chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=4
        )
    assert err.value.status_code == 401
    body = json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 4}).encode()
    req = urllib.request.Request(  # no Authorization header at all
        f"http://127.0.0.1:{gateway.port}/v1/chat/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(req, timeout=5)
    assert http.value.code == 401


def test_client_disconnect_aborts_through_the_proxy(gateway: Gateway) -> None:
    stream = gateway.openai().chat.completions.create(
        model=MODEL,
        stream=True,
        temperature=0,
        max_tokens=600,
        messages=[{"role": "user", "content": "Write a very long story about a robot."}],
    )
    got = 0
    for chunk in stream:
        got += sum(bool(c.delta.content) for c in chunk.choices)
        if got >= 3:
            break
    stream.close()  # the HTTP caller goes away: SMG sends Abort, through the proxy, with the token

    def all_free() -> bool:
        with DejaClient(gateway.replica, token=WORKER_TOKEN, retries=0) as c:
            stats, load = c.cache_stats(), c.load()
        return stats.free_device_blocks == stats.total_device_blocks and load.active_streams == 0

    assert wait_until_sync(all_free, 30, interval=0.1), "the replica still holds the request"
    assert "VllmEngine Abort" in gateway.log.read_text()
