"""The real SMG gateway (`deja gateway --worker-url ...`, PyPI `smg`) in front of two real
`deja serve` replicas on the demo model, driven with the `openai` Python client. One gateway and two replicas serve the whole module; the replica-kill test
runs last."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
from openai import APIStatusError, AuthenticationError, OpenAI

from clients.client import DejaClient
from service.common.ports import free_port
from service.common.processes import stop_gracefully
from service.gateway.command import serve_command
from tests.service.serving import (
    alive,
    core_of,
    one_token_completion,
    wait_serving,
)
from tests.support.waiting import wait_until_sync

pytestmark = pytest.mark.slow

API_KEY = "gateway-test-key"
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SERVE_ARGS = [
    "--num-device-blocks 256 --max-model-len 1024 --cpu-swap-gib 0 --max-num-seqs 16",
    "--log-level info",
]


@dataclass
class Replica:
    proc: subprocess.Popen[bytes]
    target: str
    metrics_port: int
    log: Path
    core: int

    def client(self) -> DejaClient:
        return DejaClient(self.target, retries=0)

    def requests_total(self) -> float:
        """deja_requests_total over every outcome (Generate calls that reached the servicer)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("deja_requests_total{")
        )


@dataclass
class Stack:
    replicas: list[Replica]
    gateway: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def openai(self, api_key: str = API_KEY, timeout: float = 120) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=timeout)

    def requests_total(self) -> float:
        return sum(r.requests_total() for r in self.replicas if r.proc.poll() is None)


def _start_replica(model: Path, tmp: Path, i: int) -> Replica:
    port, metrics_port = free_port(), free_port()
    log = tmp / f"replica{i}.log"
    cmd = serve_command(
        str(model), port, [*SERVE_ARGS, f"--metrics-port {metrics_port} --replica-id r{i}"]
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    root = Path(__file__).resolve().parents[2]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT)
    return Replica(proc, f"127.0.0.1:{port}", metrics_port, log, core=0)


def _get(url: str, key: str | None = API_KEY) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


@pytest.fixture(scope="module")
def stack(demo_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gateway")
    replicas: list[Replica] = []
    gateway = None
    try:
        replicas = [_start_replica(demo_model_path, tmp, i) for i in range(2)]
        for r in replicas:
            wait_serving(r.proc, r.target, r.log)
            r.core = core_of(r.proc.pid)
        port = free_port()
        log = tmp / "gateway.log"
        cmd = [
            sys.executable, "-m", "service.cli", "gateway", "--model", str(demo_model_path),
            "--port", str(port), "--metrics-port", str(free_port()), "--api-key", API_KEY,
            "--worker-url", f"grpc://{replicas[0].target}",
            "--worker-url", f"grpc://{replicas[1].target}",
            "--smg-arg", "--health-check-interval-secs 1 --health-failure-threshold 1",
            "--smg-arg", "--log-level info",
        ]  # fmt: skip
        with open(log, "wb") as f:
            gateway = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        s = Stack(replicas, gateway, port, log)

        def ready() -> bool:
            # NOTE: /v1/models lists the model before the gateway has loaded its tokenizer
            # (requests meanwhile get 503 "retry shortly"); a one-token completion answers only
            # once both are there.
            assert gateway.poll() is None, f"deja gateway exited:\n{log.read_text()}"
            code, body = _get(f"http://127.0.0.1:{port}/v1/models")
            return (
                code == 200 and MODEL in body and one_token_completion(port, MODEL, API_KEY) == 200
            )

        assert wait_until_sync(ready, 60, interval=0.2), log.read_text()[-4000:]
        yield s
    finally:
        if gateway is not None:
            stop_gracefully(gateway, 30)
        for r in replicas:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
            if r.core and alive(r.core):
                os.kill(r.core, signal.SIGKILL)


def _chat(client: OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, **kw)


def _text(resp: object) -> str:
    return resp.choices[0].message.content or ""  # type: ignore[attr-defined]


def test_chat_streamed_and_not_answer_paris(stack: Stack) -> None:
    client = stack.openai()
    full = _chat(
        client,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
    )
    assert "Paris" in _text(full), _text(full)
    assert full.choices[0].finish_reason == "stop"
    parts: list[str] = []
    usage = None
    stream = _chat(client, messages=QUESTION, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        parts.extend(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(parts) == _text(full)
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_and_models(stack: Stack) -> None:
    client = stack.openai()
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8
    )
    assert "Paris" in out.choices[0].text
    assert out.usage is not None and out.usage.completion_tokens == 8


def test_json_schema_response_format(stack: Stack) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    out = _chat(stack.openai(), messages=QUESTION, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(_text(out)), schema)


def test_n2_returns_two_choices(stack: Stack) -> None:
    out = _chat(
        stack.openai(),
        messages=QUESTION,
        temperature=1.0,
        seed=7,
        n=2,
        max_tokens=12,
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.message.content for c in out.choices)
    assert out.usage is not None and 2 <= out.usage.completion_tokens <= 24


def test_second_turn_is_served_from_the_cache(stack: Stack) -> None:
    client = stack.openai()
    system = f"You are a geography tutor, session {uuid.uuid4().hex}. Answer in one sentence."
    turn1 = [{"role": "system", "content": system}, *QUESTION]
    hits_before = sum(r.client().cache_stats().prefix_hits for r in stack.replicas)
    first = _chat(client, messages=turn1, temperature=0, max_tokens=24)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": _text(first)},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = _chat(client, messages=turn2, temperature=0, max_tokens=24)
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    block = 16
    assert details.cached_tokens >= first.usage.prompt_tokens // block * block, second.usage
    hits = sum(r.client().cache_stats().prefix_hits for r in stack.replicas) - hits_before
    assert hits >= details.cached_tokens


def test_over_long_prompt_is_400_before_any_generate(stack: Stack) -> None:
    before = stack.requests_total()
    with pytest.raises(APIStatusError) as err:
        _chat(stack.openai(), messages=[{"role": "user", "content": "hello " * 1500}], max_tokens=4)
    assert err.value.status_code == 400
    assert "context length" in str(err.value)
    assert stack.requests_total() == before


def test_unauthenticated_caller_is_rejected(stack: Stack) -> None:
    before = stack.requests_total()
    with pytest.raises(AuthenticationError):
        _chat(stack.openai(api_key="not-the-key"), messages=QUESTION, max_tokens=4)
    assert stack.requests_total() == before


def _all_free(r: Replica) -> bool:
    with r.client() as c:
        stats, load = c.cache_stats(), c.load()
    return stats.free_device_blocks == stats.total_device_blocks and load.active_streams == 0


def test_client_disconnect_aborts_and_frees_every_block(stack: Stack) -> None:
    stream = _chat(stack.openai(), stream=True, temperature=0, max_tokens=600,
        messages=[{"role": "user", "content": "Write a very long story about a robot."}],
    )  # fmt: skip
    got = 0
    for chunk in stream:
        got += sum(bool(c.delta.content) for c in chunk.choices)
        if got >= 3:
            break
    stream.close()  # the HTTP connection goes away mid-stream
    assert wait_until_sync(lambda: all(_all_free(r) for r in stack.replicas), 30, interval=0.1), (
        "blocks or streams still held after the client left"
    )
    logs = "".join(r.log.read_text() for r in stack.replicas)
    assert "VllmEngine Abort" in logs


def test_killed_replica_gets_no_more_requests(stack: Stack) -> None:
    victim, survivor = stack.replicas
    client = stack.openai(timeout=20)  # a request cut off with the victim may hang in SMG
    errors: list[BaseException] = []

    def load() -> None:
        try:
            _chat(client, messages=QUESTION, max_tokens=48)
        except Exception as e:  # requests in flight on the victim may fail
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    os.kill(victim.proc.pid, signal.SIGKILL)
    os.kill(victim.core, signal.SIGKILL)
    victim.proc.wait()
    for t in threads:
        t.join(120)
    time.sleep(3)  # the gateway's health check (every second here) marks the victim down
    before = survivor.requests_total()
    for i in range(6):
        out = _chat(client, temperature=0, max_tokens=8,
            messages=[{"role": "user", "content": f"Say the number {i}."}],
        )  # fmt: skip
        assert out.choices[0].message.content
    assert survivor.requests_total() - before == 6
    with contextlib.suppress(grpc.RpcError):
        assert _all_free(survivor)
