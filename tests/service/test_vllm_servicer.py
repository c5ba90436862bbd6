"""VllmEngine (the SMG gateway's protocol) on a real replica over the tiny Llama, called with the
generated vllm stubs: the mapping of each RPC, delta streaming, n > 1, seeds, logprobs, stop ids,
structured outputs, bad input, auth by metadata, KV events and the tokenizer bundle."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as spb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine.frontend.prompt import prompt_block_hashes
from engine.testing.tiny_gguf import write_gguf
from service.replica.vllm_convert import block_hash_int64, tokenizer_chunks
from tests.service.conftest import Harness, StartServer, make_engine
from tests.support.waiting import wait_until

PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks of 16


@pytest.fixture
async def stub(server: Harness) -> AsyncIterator[vpb_grpc.VllmEngineStub]:
    async with grpc.aio.insecure_channel(server.target) as ch:
        yield vpb_grpc.VllmEngineStub(ch)


def request(stream: bool, *, prompt: list[int] = PROMPT, **sampling: Any) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="r1",
        tokenized=vpb.TokenizedInput(input_ids=prompt),
        sampling_params=vpb.SamplingParams(**sampling),  # type: ignore[arg-type]
        stream=stream,
    )


async def collect(
    stub: vpb_grpc.VllmEngineStub, req: vpb.GenerateRequest
) -> list[vpb.GenerateResponse]:
    return [r async for r in stub.Generate(req)]


async def test_stream_is_deltas_then_one_complete_per_choice(
    server: Harness, stub: vpb_grpc.VllmEngineStub
) -> None:
    params: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    streamed = await collect(stub, request(True, **params))
    full = await collect(stub, request(False, **params))
    chunks = [r.chunk for r in streamed if r.HasField("chunk")]
    completes = [r.complete for r in streamed if r.HasField("complete")]
    assert len(completes) == 1 and streamed[-1].HasField("complete")
    ids = [t for c in chunks for t in c.token_ids]
    assert len(ids) == 8 and all(c.prompt_tokens == len(PROMPT) for c in chunks)
    assert completes[0].finish_reason == "length" and completes[0].completion_tokens == 8
    assert not completes[0].output_ids  # streaming: the chunks carried every id
    assert [r.WhichOneof("response") for r in full] == ["complete"]
    assert list(full[0].complete.output_ids) == ids  # greedy: same ids
    # The second run found the first one's two full prompt blocks.
    assert full[0].complete.cached_tokens == 32 and full[0].complete.prompt_tokens == 40
    await server.assert_clean()


async def test_n2_seed_logprobs_and_stop_token(stub: vpb_grpc.VllmEngineStub) -> None:
    params: dict[str, Any] = {"temperature": 1.0, "max_tokens": 6, "n": 2, "seed": 5, "logprobs": 2,
              "ignore_eos": True}  # fmt: skip
    a = await collect(stub, request(False, **params))
    b = await collect(stub, request(False, **params))
    assert sorted(r.complete.index for r in a) == [0, 1]
    assert [list(r.complete.output_ids) for r in a] == [list(r.complete.output_ids) for r in b]
    for r in a:
        lp = r.complete.output_logprobs
        assert list(lp.token_ids) == list(r.complete.output_ids)
        assert all(len(t.token_ids) == 2 for t in lp.top_logprobs)
    stopped = await collect(stub, request(False, temperature=0.0, max_tokens=6, ignore_eos=True))
    stop_at = stopped[0].complete.output_ids[1]
    out = await collect(
        stub, request(False, temperature=0.0, max_tokens=6, stop_token_ids=[stop_at])
    )
    assert out[0].complete.finish_reason == "stop" and out[0].complete.matched_token_id == stop_at
    assert list(out[0].complete.output_ids)[-1] == stop_at


async def test_min_tokens_and_no_max_tokens(stub: vpb_grpc.VllmEngineStub) -> None:
    out = await collect(stub, request(False, temperature=0.0, max_tokens=5, min_tokens=5))
    assert out[0].complete.completion_tokens == 5
    # No max_tokens: up to max_model_len (1024) unless EOS comes first (the engine's own stop).
    unbounded = await collect(stub, request(False, temperature=0.0))
    c = unbounded[0].complete
    assert c.completion_tokens > 16 or c.finish_reason == "stop"


async def test_structured_output_choice(stub: vpb_grpc.VllmEngineStub) -> None:
    req = request(False, temperature=1.0, max_tokens=16, seed=1,
                  choice=vpb.ChoiceConstraint(choices=["yes", "no"]))  # fmt: skip
    out = await collect(stub, req)
    assert out[0].complete.finish_reason == "stop" and out[0].complete.output_ids


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (vpb.GenerateRequest(request_id="x"), "no input"),
        (request(False, prompt_logprobs=1), "prompt_logprobs"),
        (request(False, structural_tag="{}"), "structural_tag"),
        (request(False, top_p=1.5), "top_p"),
        (request(False, json_schema="{not json"), "schema"),
        (
            vpb.GenerateRequest(request_id="y", tokenized=vpb.TokenizedInput(input_ids=[10**7])),
            "vocab",
        ),
    ],
)
async def test_bad_input_is_invalid_argument(
    stub: vpb_grpc.VllmEngineStub, req: vpb.GenerateRequest, needle: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in (err.value.details() or "").lower()


async def test_info_loads_health_and_no_sglang(
    server: Harness, stub: vpb_grpc.VllmEngineStub
) -> None:
    info = await stub.GetModelInfo(vpb.GetModelInfoRequest())
    mi = server.engine.model_info
    assert info.max_context_length == mi.max_model_len and info.vocab_size == mi.vocab_size
    assert info.served_model_name == mi.model_id and info.tokenizer_path
    assert list(info.eos_token_ids) == list(mi.eos_token_ids)
    assert (await stub.HealthCheck(vpb.HealthCheckRequest())).healthy
    loads = await stub.GetLoads(vpb.GetLoadsRequest())
    assert loads.dp_rank_count == 1
    assert loads.loads[0].max_total_num_tokens == mi.num_device_blocks * mi.block_size
    server_info = await stub.GetServerInfo(vpb.GetServerInfoRequest())
    assert server_info.block_size == mi.block_size
    async with grpc.aio.insecure_channel(server.target) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await spb_grpc.SglangSchedulerStub(ch).HealthCheck(spb.HealthCheckRequest())
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_tokenizer_bundle_is_a_zip_with_its_sha256(stub: vpb_grpc.VllmEngineStub) -> None:
    chunks = [c async for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and not any(n.endswith(".safetensors") for n in names)
    parts = list(tokenizer_chunks(b"x" * 5, "h", chunk_bytes=2))
    assert [p.data for p in parts] == [b"xx", b"xx", b"x"] and parts[-1].sha256 == "h"


async def test_abort_ends_the_stream_and_frees_blocks(
    server: Harness, stub: vpb_grpc.VllmEngineStub
) -> None:
    call = stub.Generate(request(True, temperature=0.0, max_tokens=500, ignore_eos=True))
    first = await call.read()
    assert first.HasField("chunk")
    await stub.Abort(vpb.AbortRequest(request_ids=["r1"]))
    rest = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        rest.append(msg)
    assert rest[-1].complete.finish_reason == "abort"
    await server.assert_clean()


async def test_auth_from_metadata(start_server: StartServer) -> None:
    h = await start_server(auth_tokens=(("tok", "tenant-a"),), token="tok")
    async with grpc.aio.insecure_channel(h.target) as ch:
        stub = vpb_grpc.VllmEngineStub(ch)
        for call in (
            stub.HealthCheck(vpb.HealthCheckRequest()),
            stub.GetModelInfo(vpb.GetModelInfoRequest()),
            collect(stub, request(False, max_tokens=2)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        md = (("authorization", "Bearer tok"),)
        fresh = list(range(400, 440))
        req = request(False, prompt=fresh, max_tokens=2)
        out = [r async for r in stub.Generate(req, metadata=md)]
        assert out[0].complete.completion_tokens == 2
    # The engine hashed the prompt with the tenant's salt (from the metadata), not unsalted.
    model = h.engine.model_info.model_id
    cached = set(await h.engine.cached_block_hashes(100_000))
    assert set(prompt_block_hashes(fresh, 16, model, "tenant:tenant-a")) <= cached
    assert not set(prompt_block_hashes(fresh, 16, model, None)) & cached


async def test_kv_events_stream_and_resume(server: Harness, stub: vpb_grpc.VllmEngineStub) -> None:
    got: list[common_pb2.KvEventBatch] = []

    async def read(start: int) -> None:
        async for b in stub.SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest(start_sequence_number=start)
        ):
            got.append(b)

    task = asyncio.create_task(read(0))
    await wait_until(lambda: len(got) >= 1, what="the snapshot")
    assert got[0].events[0].WhichOneof("data") == "cleared"
    fresh = list(range(300, 340))  # not cached by another test on the shared engine
    await collect(stub, request(False, prompt=fresh, temperature=0.0, max_tokens=2))
    model = server.engine.model_info.model_id
    want = {block_hash_int64(x) for x in prompt_block_hashes(fresh, 16, model, None)}

    def stored() -> set[int]:
        return {
            b.block_hash
            for m in got
            for e in m.events
            if e.WhichOneof("data") == "stored"
            for b in e.stored.blocks
        }

    await wait_until(lambda: want <= stored(), what="the prompt's blocks")
    live = next(m for m in got[1:] if any(e.WhichOneof("data") == "stored" for e in m.events))
    blk = next(e.stored for e in live.events if e.WhichOneof("data") == "stored").blocks[0]
    assert list(blk.token_ids) == fresh[:16] and blk.block_size == 16
    task.cancel()
    # Resuming at a live batch's number gives that batch again, no snapshot.
    again: list[common_pb2.KvEventBatch] = []
    req = common_pb2.SubscribeKvEventsRequest(start_sequence_number=live.sequence_number)
    async for b in stub.SubscribeKvEvents(req):
        again.append(b)
        break
    assert again[0] == live


async def test_a_gguf_replica_hands_out_its_tokenizer_files(
    start_server: StartServer, tiny_llama_path: Path, tmp_path: Path
) -> None:
    """A GGUF file holds its tokenizer inside: the replica writes its files out once, so the
    gateway gets the same tokenizer (and chat template) from GetTokenizer and GetModelInfo."""
    from transformers import AutoTokenizer

    file = write_gguf(tiny_llama_path, tmp_path / "model.gguf", {"proj": "Q4_0"})
    engine = make_engine(file, in_process=True)
    try:
        h = await start_server(engine)
        async with grpc.aio.insecure_channel(h.target) as ch:
            stub = vpb_grpc.VllmEngineStub(ch)
            chunks = [c async for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
            info = await stub.GetModelInfo(vpb.GetModelInfoRequest())
        data = b"".join(c.data for c in chunks)
        assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
        out = tmp_path / "unzipped"
        zipfile.ZipFile(io.BytesIO(data)).extractall(out)
        assert (out / "tokenizer.json").is_file()
        got = AutoTokenizer.from_pretrained(str(out))
        text = "Hello there, how are you?"
        assert got.encode(text) == engine.tokenizer.encode(text)
        msgs = [{"role": "user", "content": "hi"}]
        assert got.apply_chat_template(
            msgs, tokenize=False
        ) == engine.tokenizer.apply_chat_template(msgs, tokenize=False)
        assert Path(info.tokenizer_path).is_dir() and info.tokenizer_path != str(tmp_path)
    finally:
        engine.shutdown()
