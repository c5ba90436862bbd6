"""Engine behaviour: prefix hits, salts, bad input, n>1, stops, seeds, aborts — blocks always freed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.errors import StreamOverflowError
from engine.frontend.async_engine import AsyncEngine
from tests.support.prompts import rand_tokens
from tests.support.waiting import wait_until


def all_free(llm_engine: EngineCore) -> None:
    kv = llm_engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    assert not llm_engine.requests


@pytest.fixture(scope="module")
def llm(tiny_llama_path: Path) -> LLM:
    return LLM(str(tiny_llama_path), num_device_blocks=256, max_num_batched_tokens=512)


@pytest.fixture(autouse=True)
def _blocks_free_after(request: pytest.FixtureRequest) -> object:
    yield
    if "llm" in request.fixturenames:
        eng = request.getfixturevalue("llm").engine.core
        all_free(eng)


GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_shared_512_prefix_is_cached(llm: LLM) -> None:
    prefix = rand_tokens(512, 1)
    first = llm.generate([prefix + rand_tokens(20, 2)], GREEDY)[0]
    second = llm.generate([prefix + rand_tokens(20, 3)], GREEDY)[0]
    assert first.num_cached_tokens == 0 or first.num_cached_tokens < 512
    assert second.num_cached_tokens >= 496
    assert second.cached_tokens.device == second.num_cached_tokens
    salted = llm.generate([prefix + rand_tokens(20, 3)], GREEDY, cache_salt="tenant-b")[0]
    assert salted.num_cached_tokens == 0
    # Same salt again: that tenant's own cache hits.
    again = llm.generate([prefix + rand_tokens(20, 4)], GREEDY, cache_salt="tenant-b")[0]
    assert again.num_cached_tokens >= 496


def test_cached_output_equals_uncached(llm: LLM) -> None:
    prompt = rand_tokens(300, 5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    a = llm.generate([prompt], params)[0]
    b = llm.generate([prompt], params)[0]
    assert b.num_cached_tokens >= 288
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty"),
        ("", SamplingParams(), "empty"),
        ([1, 2, 999_999], SamplingParams(), "outside the vocabulary"),
        ([-1], SamplingParams(), "outside the vocabulary"),
        ([5] * 2048, SamplingParams(), "max_model_len"),
        ([5, 6], SamplingParams(temperature=-1), "temperature"),
        ([5, 6], SamplingParams(top_p=0), "top_p"),
        ([5, 6], SamplingParams(top_k=-5), "top_k"),
        ([5, 6], SamplingParams(min_p=2), "min_p"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
        ([5, 6], SamplingParams(n=1000), "n must be"),
        ([5, 6], SamplingParams(logprobs=1000), "logprobs"),
        ([5, 6], SamplingParams(stop_token_ids=[10**7]), "stop token id"),
        ([5, 6], SamplingParams(repetition_penalty=0), "repetition_penalty"),
        ([5, 6], SamplingParams(min_tokens=9, max_tokens=3), "min_tokens"),
    ],
)
def test_bad_input_is_rejected_before_allocation(
    llm: LLM, prompt: list[int] | str, params: SamplingParams, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params)  # type: ignore[list-item]
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks


def test_mismatched_params_list(llm: LLM) -> None:
    with pytest.raises(ValueError, match="one for all or one per prompt"):
        llm.generate([[5, 6], [7, 8]], [GREEDY])


def test_n_samples_share_prompt_blocks_and_differ(llm: LLM) -> None:
    prompt = rand_tokens(40, 7)  # 2 full blocks + a partial one shared by the samples
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # Greedy n=2 gives the same sample twice, through copy-on-write of the partial block.
    g = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True))[0]
    single = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert g.outputs[0].token_ids == g.outputs[1].token_ids == single.token_ids


def test_seed_is_independent_of_batch(llm: LLM) -> None:
    prompt = rand_tokens(30, 8)
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    alone = llm.generate([prompt], p)[0].token_ids
    others = [rand_tokens(50, s) for s in range(9, 14)]
    batch = llm.generate(
        [*others[:2], prompt, *others[2:]],
        [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)] * 2
        + [p]
        + [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)] * 3,
    )
    assert batch[2].token_ids == alone


def test_max_tokens_min_tokens_and_stop_ids(llm: LLM) -> None:
    prompt = rand_tokens(20, 15)
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stop_at = base.token_ids[3]
    first = base.token_ids.index(stop_at)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at])
    )[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    assert out.token_ids == base.token_ids[: first + 1]
    # min_tokens suppresses the stop token id until enough tokens exist.
    out = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=10, min_tokens=first + 2, stop_token_ids=[stop_at]
        ),
    )[0]
    assert len(out.token_ids) >= first + 2
    assert stop_at not in out.token_ids[: first + 1] or out.token_ids.index(stop_at) >= first + 1


def test_stop_string_is_cut_from_text(llm: LLM) -> None:
    prompt = rand_tokens(20, 16)
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    text = base.text
    assert len(text) >= 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_logprobs(llm: LLM) -> None:
    out = llm.generate(
        [rand_tokens(10, 17)], SamplingParams(temperature=0, max_tokens=3, logprobs=3)
    )[0]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, lps, strict=True):
        assert lp.token_id == tok
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the chosen token is the best
        assert lp.logprob <= 0


def test_prompt_too_big_for_pool_fails_cleanly(tiny_llama_path: Path) -> None:
    small = LLM(str(tiny_llama_path), num_device_blocks=4, block_size=16)
    out = small.generate([rand_tokens(100, 18), rand_tokens(10, 19)], GREEDY)
    assert out[0].finish_reason == "error" and "KV cache" in (out[0].error or "")
    assert out[1].finish_reason == "length"
    all_free(small.engine.core)


def test_abort_frees_blocks(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request(
        rand_tokens(100, 20), SamplingParams(max_tokens=50, ignore_eos=True), request_id="a"
    )
    eng.add_request(
        rand_tokens(60, 21), SamplingParams(max_tokens=50, ignore_eos=True), request_id="b"
    )
    eng.step()
    eng.step()
    assert eng.core.kv.num_free_blocks < eng.core.kv.num_blocks
    assert eng.abort("a")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["a"].finished and outs["a"].finish_reason == "abort"
    eng.abort("b")
    eng.collect_outputs()
    all_free(eng.core)


def test_chat_messages(llm: LLM) -> None:
    ids = llm.engine.tokenize(messages=[{"role": "user", "content": "hello there"}])
    assert len(ids) > 3
    with pytest.raises(ValueError, match="empty"):
        llm.engine.tokenize(messages=[])


def test_unknown_engine_option(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(str(tiny_llama_path), no_such_option=1)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_llama_path), block_size=7)


# -- AsyncEngine ---------------------------------------------------------------------------------


STREAM_BUFFER = 32


@pytest.fixture(scope="module")
def aengine(tiny_llama_path: Path) -> object:
    cfg = EngineConfig.from_kwargs(str(tiny_llama_path), num_device_blocks=256)
    # Above every output a reading test asks for (a loaded CI machine can run the engine several
    # steps ahead of the reader), below the slow-reader test's 300 tokens.
    eng = AsyncEngine.from_config(cfg, stream_buffer=STREAM_BUFFER)
    eng.start()
    yield eng
    eng.shutdown()
    all_free(eng.engine)


async def _wait_free(eng: AsyncEngine) -> None:
    def free() -> bool:
        s = eng.get_stats()
        return s.free_device_blocks == eng.model_info.num_device_blocks and s.num_running == 0

    await wait_until(free, 5, what="every block freed")


async def test_async_stream_matches_offline(aengine: AsyncEngine, llm: LLM) -> None:
    prompt = rand_tokens(50, 30)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    offline = llm.generate([prompt], params)[0]
    tokens: list[int] = []
    text = ""
    last = None
    async for out in aengine.generate(prompt, params):
        for o in out.outputs:
            tokens += o.token_ids
            text += o.text
        last = out
    assert last is not None and last.finished
    assert last.outputs[-1].finish_reason == "length"
    assert tokens == offline.token_ids and text == offline.text
    m = last.metrics
    assert m is not None and m.ttft is not None and m.queue_time is not None
    # Queue time ends when the request is scheduled, before its first forward pass.
    assert m.first_scheduled is not None and m.first_token is not None
    assert m.first_scheduled < m.first_token


async def test_async_concurrent_and_cancel(aengine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def one(i: int) -> int:
        n = 0
        async for out in aengine.generate(rand_tokens(20 + i, i), params):
            n += sum(len(o.token_ids) for o in out.outputs)
        return n

    counts = await asyncio.gather(*(one(i) for i in range(16)))
    assert counts == [6] * 16

    # Leaving the stream early aborts the request and frees its blocks.
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    agen = aengine.generate(rand_tokens(40, 99), long)
    async for _ in agen:
        break
    await agen.aclose()
    await _wait_free(aengine)


async def test_async_bad_input_and_duplicate_id(aengine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        async for _ in aengine.generate([], SamplingParams()):
            pass
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    first = aengine.generate(rand_tokens(10, 1), params, request_id="dup")
    await first.__anext__()
    with pytest.raises(ValueError, match="already in use"):
        async for _ in aengine.generate(rand_tokens(10, 1), params, request_id="dup"):
            pass
    await first.aclose()
    await _wait_free(aengine)


async def test_async_slow_reader_overflows(aengine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    agen = aengine.generate(rand_tokens(10, 3), params)
    await agen.__anext__()
    # The buffer of STREAM_BUFFER deltas fills while nobody reads: the engine closes the stream.
    await wait_until(lambda: any(s.closed for s in aengine._streams.values()), what="overflow")
    with pytest.raises(StreamOverflowError):
        async for _ in agen:
            pass
    await _wait_free(aengine)


def test_partial_prefill_limit_admits_prompts_one_after_another(tiny_llama_path: Path) -> None:
    """`max_num_partial_prefills=1`: one prompt in prefill a step, decodes alongside; the same
    greedy tokens as packing every prompt into one step."""
    prompts = [rand_tokens(40 + 10 * i, seed=70 + i) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    packed = LLM(str(tiny_llama_path), num_device_blocks=64, max_num_batched_tokens=512)
    one = LLM(
        str(tiny_llama_path),
        num_device_blocks=64,
        max_num_batched_tokens=512,
        max_num_partial_prefills=1,
    )
    for i, p in enumerate(prompts):
        one.engine.add_request(p, params, request_id=str(i))
    running = []
    for _ in range(3):
        one.engine.step()
        running.append(len(one.engine.core.scheduler.running))
    assert running == [1, 2, 3]  # one admitted a step; the earlier ones decode meanwhile
    while one.engine.has_unfinished_requests():
        one.engine.step()
    expected = [o.outputs[0].token_ids for o in packed.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    assert got == expected
