"""The front end's text (engine/frontend/output_text.py) against one decode of the whole output:
the core sends token deltas, `RequestText` turns them into the text a caller sees."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.frontend.output_text import OutputText, RequestText
from engine.outputs import CompletionOutput, RequestOutput
from engine.worker.model_loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: Path):  # type: ignore[no-untyped-def]
    return load_tokenizer(str(tiny_llama_path))


def _decode(tokenizer, ids: list[int]) -> str:  # type: ignore[no-untyped-def]
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _word_ids(tokenizer, n: int, seed: int) -> list[int]:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "x", "yz"]) for _ in range(n))
    return list(tokenizer(words, add_special_tokens=False)["input_ids"])


def _stream(
    text: RequestText, ids: list[int], finish: str | None, stop_reason: int | str | None, seed: int
) -> str:
    """Feeds `ids` as deltas of random sizes, the last one finishing; returns the joined text."""
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        last = i + n >= len(ids)
        c = CompletionOutput(
            0,
            token_ids=ids[i : i + n],
            finish_reason=finish if last else None,
            stop_reason=stop_reason if last else None,
        )
        text.apply(RequestOutput("r", [], [c], finished=last))
        pieces.append(c.text)
        i += n
    return "".join(pieces)


def test_deltas_join_to_one_decode(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = _word_ids(tokenizer, 30, 1)
    params = SamplingParams(max_tokens=len(ids))
    got = _stream(RequestText(tokenizer, [1, 2], params), ids, "length", None, 2)
    assert got == _decode(tokenizer, ids)
    # aborted: no flush, and the text is a prefix of the whole decode
    got = _stream(RequestText(tokenizer, [1, 2], params), ids, "abort", None, 3)
    assert _decode(tokenizer, ids).startswith(got)


def test_the_token_that_stops_a_sample_is_not_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = _word_ids(tokenizer, 20, 4)
    stop_id = ids[-1]
    params = SamplingParams(stop_token_ids=[stop_id])
    got = _stream(RequestText(tokenizer, [], params), ids, "stop", stop_id, 5)
    assert got == _decode(tokenizer, ids[:-1])
    got = _stream(RequestText(tokenizer, [], SamplingParams()), ids, "stop", None, 6)  # EOS
    assert got == _decode(tokenizer, ids[:-1])


def test_a_stop_string_cuts_where_the_core_stopped(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = _word_ids(tokenizer, 30, 7)
    whole = _decode(tokenizer, ids)
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    # the core stops at the first token whose text completes the stop string
    end = next(k for k in range(1, len(ids) + 1) if stop in _decode(tokenizer, ids[:k]))
    params = SamplingParams(stop=[stop])
    got = _stream(RequestText(tokenizer, [], params), ids[:end], "stop", stop, 8)
    assert got == whole[: whole.index(stop)]


def test_beams_are_decoded_whole(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = _word_ids(tokenizer, 12, 9)
    params = SamplingParams(use_beam_search=True, n=2, temperature=0.0, max_tokens=12)
    outs = [CompletionOutput(i, token_ids=ids[i:], finish_reason="length") for i in range(2)]
    RequestText(tokenizer, [], params).apply(RequestOutput("r", [], outs, finished=True))
    assert [c.text for c in outs] == [_decode(tokenizer, ids[i:]) for i in range(2)]


def test_finished_requests_are_forgotten(tiny_llama_path: Path) -> None:
    llm = LLM(str(tiny_llama_path))
    eng = llm.engine
    outs = llm.generate(
        [[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=6, n=2, ignore_eos=True)
    )
    assert all(len(c.token_ids) == 6 for o in outs for c in o.outputs)
    assert len(eng.text) == 0
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    eng.step()
    assert len(eng.text) == 1
    eng.abort("a")
    assert [o.finish_reason for o in eng.collect_outputs()] == ["abort"]
    assert len(eng.text) == 0
    assert isinstance(eng.text, OutputText)
