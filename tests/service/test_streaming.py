"""Acceptance 1: a real server and the real client; streams equal the engine's offline output."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import AsyncDejaClient, DejaClient, GenerateResult
from clients.session import AsyncChatSession
from engine import LLM, SamplingParams
from service.api.deja.v1 import inference_pb2 as pb
from tests.service.certs import make_pki
from tests.service.conftest import ENGINE_KWARGS, Harness, StartServer

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "The capital of France is",
    "Machine learning models predict",
]


@pytest.fixture(scope="module")
def offline(tiny_llama_path: Path) -> LLM:
    return LLM(model=str(tiny_llama_path), **ENGINE_KWARGS)


def _offline_greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[tuple[str, list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [(o.text, o.token_ids) for o in llm.generate(prompts, params)]


async def test_stream_equals_offline_greedy(server: Harness, offline: LLM) -> None:
    expected = _offline_greedy(offline, PROMPTS, 24)
    for prompt, (text, ids) in zip(PROMPTS, expected, strict=True):
        deltas: list[pb.GenerateResponse] = []
        async for msg in server.client.generate(
            prompt, max_tokens=24, temperature=0.0, return_token_ids=True
        ):
            deltas.append(msg)
        result = GenerateResult()
        for msg in deltas:
            result.add(msg, elapsed_s=0.0)
        assert result.token_ids == ids
        assert result.text == text
        assert len(deltas) > 1, "the answer must stream in several messages"
        assert all(not m.HasField("final") for m in deltas[:-1])
        final = deltas[-1].final
        assert final.choices[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 24
        assert final.usage.prompt_tokens == len(result.prompt_token_ids) > 0
        assert final.replica_id == server.replica.replica_id
        assert 0 <= final.timings.queue_s <= final.timings.ttft_s <= final.timings.total_s
    await server.assert_clean()


async def test_64_concurrent_streams(server: Harness, offline: LLM) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]
    expected = _offline_greedy(offline, prompts, 8)

    async def one(prompt: str) -> GenerateResult:
        return await server.client.complete(prompt, max_tokens=8, temperature=0.0)

    results = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 120)
    for result, (text, ids) in zip(results, expected, strict=True):
        assert result.finish_reason == "length"
        assert result.usage.completion_tokens == 8 == len(ids)
        assert result.text == text
    await server.assert_clean()


async def test_sync_client_in_a_thread(server: Harness, offline: LLM) -> None:
    [(text, ids)] = _offline_greedy(offline, PROMPTS[:1], 12)

    def run() -> GenerateResult:
        with DejaClient(server.target, timeout=30) as client:
            assert client.model_info().vocab_size > 0
            return client.complete(
                PROMPTS[0], max_tokens=12, temperature=0.0, return_token_ids=True
            )

    result = await asyncio.to_thread(run)
    assert result.token_ids == ids and result.text == text


async def test_token_ids_chat_n_and_logprobs(server: Harness) -> None:
    ids = await server.client.tokenize("The quick brown fox")
    by_text = await server.client.complete("The quick brown fox", max_tokens=6, temperature=0)
    by_ids = await server.client.complete(ids, max_tokens=6, temperature=0)
    assert by_ids.text == by_text.text

    chat = [{"role": "user", "content": "What is your name?"}]
    rendered = await server.client.tokenize(messages=chat)
    result = await server.client.complete(messages=chat, max_tokens=5, temperature=0)
    assert result.usage.prompt_tokens == len(rendered)

    many = await server.client.complete(
        "Once upon a time", n=3, max_tokens=5, temperature=1.0, seed=7, logprobs=2
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    for c in many.choices:
        assert c.finish_reason == "length"
        assert len(c.logprobs) == 5
        assert all(len(lp.top) == 2 for lp in c.logprobs)
    assert many.usage.completion_tokens == 15
    await server.assert_clean()


async def test_chat_session_reuses_cache_across_turns(server: Harness) -> None:
    system = "You are Deja. " + "The sun rises in the east and sets in the west. " * 6
    session = AsyncChatSession(server.client, system=system, max_tokens=8, temperature=0.0)
    first = await session.ask("What is your name?")
    assert session.messages[-1] == {"role": "assistant", "content": first}
    r1 = session.last_result
    await session.ask("How are you today?")
    r2 = session.last_result
    assert r1 is not None and r2 is not None
    assert len(session.messages) == 5  # system, user, assistant, user, assistant
    assert r2.usage.prompt_tokens > r1.usage.prompt_tokens
    # The second turn's prompt starts with the first turn's: its full blocks come from the cache.
    assert r2.usage.cached_prompt_tokens >= 16
    assert r2.usage.cached_by_tier.device == r2.usage.cached_prompt_tokens
    sid = session.session_id
    session.reset()
    assert session.session_id != sid and len(session.messages) == 1


async def test_tenant_isolation(start_server: StartServer) -> None:
    a = await start_server(auth_tokens=(("tok-a", "acme"), ("tok-b", "globex")), token="tok-a")
    b = AsyncDejaClient(a.target, token="tok-b", retries=0)
    prompt = "The robot painted the sky blue and the grass green. " * 3
    first = await a.client.complete(prompt, max_tokens=2, temperature=0)
    again = await a.client.complete(prompt, max_tokens=2, temperature=0)
    other = await b.complete(prompt, max_tokens=2, temperature=0, cache_salt="tenant:acme")
    await b.close()
    assert first.usage.cached_prompt_tokens == 0
    assert again.usage.cached_prompt_tokens >= 16
    # Another tenant never hits acme's blocks, whatever salt it sends.
    assert other.usage.cached_prompt_tokens == 0
    await a.assert_clean()


async def test_client_salt_honoured_without_auth(server: Harness) -> None:
    prompt = "Water boils at one hundred degrees. " * 5
    await server.client.complete(prompt, max_tokens=2, temperature=0, cache_salt="x")
    same = await server.client.complete(prompt, max_tokens=2, temperature=0, cache_salt="x")
    other = await server.client.complete(prompt, max_tokens=2, temperature=0, cache_salt="y")
    assert same.usage.cached_prompt_tokens >= 16
    assert other.usage.cached_prompt_tokens == 0


async def test_abort_rpc_ends_stream_with_abort(server: Harness) -> None:
    stream = server.client.generate(
        "Once upon a time", request_id="r-1", max_tokens=900, ignore_eos=True, temperature=0
    )
    first = await anext(stream)
    assert first.request_id == "r-1"
    assert await server.client.abort("r-1", "unknown") == ["r-1"]
    rest = [m async for m in stream]
    assert rest and rest[-1].final.choices[0].finish_reason == pb.FINISH_REASON_ABORT
    await server.assert_clean()


async def test_retry_on_unavailable_before_first_message(start_server: StartServer) -> None:
    from service.common.ports import free_port

    port = free_port()
    client = AsyncDejaClient(f"127.0.0.1:{port}", retries=6, retry_backoff_s=0.1)
    task = asyncio.create_task(client.complete("Hello", max_tokens=3, temperature=0))
    await asyncio.sleep(0.3)  # the first attempts find no server: UNAVAILABLE
    h = await start_server(port=port)
    result = await asyncio.wait_for(task, 30)
    await client.close()
    assert result.usage.completion_tokens == 3
    assert h.replica.port == port


async def test_tls_with_bearer_token(start_server: StartServer, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    proc = await asyncio.create_subprocess_exec(
        "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    if await proc.wait() != 0:
        pytest.skip("openssl cannot make a test certificate")
    h = await start_server(tls_cert=str(cert), tls_key=str(key), auth_tokens=(("s3cret", "t"),))
    client = AsyncDejaClient(
        f"localhost:{h.replica.port}", tls=True, root_certificates=cert.read_bytes(), token="s3cret"
    )
    try:
        result = await client.complete("Hello", max_tokens=3, temperature=0)
        assert result.usage.completion_tokens == 3
    finally:
        await client.close()
    plain = AsyncDejaClient(f"localhost:{h.replica.port}", token="s3cret", retries=0)
    with pytest.raises(grpc.aio.AioRpcError):
        await plain.complete("Hello", max_tokens=3, timeout=5)
    await plain.close()


async def test_mtls_refuses_callers_without_a_client_certificate(
    start_server: StartServer, tmp_path: Path
) -> None:
    pki = make_pki(tmp_path / "pki")
    h = await start_server(
        tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca)
    )
    ca = pki.ca.read_bytes()
    with_cert = grpc.ssl_channel_credentials(
        ca, pki.client_key.read_bytes(), pki.client_cert.read_bytes()
    )
    request = health_pb2.HealthCheckRequest()
    async with grpc.aio.secure_channel(h.target, with_cert) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(request, timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    no_cert = grpc.ssl_channel_credentials(ca)
    for channel in (grpc.aio.insecure_channel(h.target),  # plaintext; TLS without a certificate
                    grpc.aio.secure_channel(h.target, no_cert)):  # fmt: skip
        async with channel as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(ch).Check(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    client = AsyncDejaClient(h.target, tls=True, root_certificates=ca, retries=0)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.complete("Hello", max_tokens=2, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await client.close()
