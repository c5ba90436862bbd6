"""Beam search and best_of over deja.v1: a real server on a free port, a real client."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from engine import LLM, SamplingParams
from service.api.deja.v1 import inference_pb2 as pb
from tests.service.conftest import ENGINE_KWARGS, Harness


async def test_beam_search_matches_offline(server: Harness, tiny_llama_path: object) -> None:
    prompt = [11, 57, 203, 99, 14, 301, 72]
    res = await server.client.complete(
        prompt,
        n=2,
        best_of=4,
        temperature=0.0,
        use_beam_search=True,
        early_stopping=pb.EARLY_STOPPING_TRUE,
        length_penalty=1.0,
        max_tokens=10,
        return_token_ids=True,
    )
    llm = LLM(str(tiny_llama_path), **ENGINE_KWARGS)
    params = SamplingParams(
        n=2, best_of=4, temperature=0.0, use_beam_search=True, early_stopping=True, max_tokens=10
    )
    (want,) = llm.generate(prompt, params)
    assert [c.token_ids for c in res.choices] == [c.token_ids for c in want.outputs]
    assert [c.index for c in res.choices] == [0, 1]
    for got, exp in zip(res.choices, want.outputs, strict=True):
        assert got.finish_reason == exp.finish_reason
        assert got.cumulative_logprob == pytest.approx(exp.cumulative_logprob, abs=1e-4)
    # The whole answer comes in one message (beams change until the search ends).
    assert res.num_messages == 1
    await server.assert_clean()


async def test_best_of_returns_the_n_most_likely(server: Harness) -> None:
    res = await server.client.complete(
        "hello there", n=2, best_of=5, temperature=1.0, seed=3, max_tokens=8
    )
    assert len(res.choices) == 2
    lps = [c.cumulative_logprob for c in res.choices]
    assert all(lp is not None for lp in lps) and lps[0] >= lps[1]  # type: ignore[operator]
    await server.assert_clean()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_beam_search": True, "temperature": 0.7}, "beam search is deterministic"),
        ({"use_beam_search": True, "temperature": 0.0, "stop": ["x"]}, "stop strings"),
        ({"use_beam_search": True, "temperature": 0.0, "top_k": 5}, "top_k"),
        ({"n": 3, "best_of": 2, "temperature": 1.0}, "best_of must be between n (3)"),
        ({"best_of": 3, "temperature": 0.0}, "best_of > 1 with greedy sampling"),
    ],
)
async def test_bad_beam_settings_are_invalid_argument(
    server: Harness, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await server.client.complete("hi", max_tokens=4, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")
    await server.assert_clean()
