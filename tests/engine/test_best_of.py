"""best_of: sample best_of, return the n with the highest cumulative logprob; bad settings refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.sample.sampling_params import SamplingParams as SP


@pytest.fixture(scope="module")
def llm(tiny_llama_path: Path) -> LLM:
    return LLM(str(tiny_llama_path), dtype="float32", block_size=16, num_device_blocks=256)


def test_best_of_keeps_the_most_likely_samples(llm: LLM) -> None:
    prompt = [17, 230, 41, 99, 8, 310]
    # The same seed draws the same four samples (one generator per sample: seed + index).
    (all4,) = llm.generate(prompt, SamplingParams(n=4, seed=7, max_tokens=9, logprobs=0))
    (best,) = llm.generate(prompt, SamplingParams(n=2, best_of=4, seed=7, max_tokens=9))
    sums = [sum(lp.logprob for lp in c.logprobs or []) for c in all4.outputs]
    for c, s in zip(all4.outputs, sums, strict=True):
        assert c.cumulative_logprob == pytest.approx(s, abs=1e-5)
    ranked = sorted(all4.outputs, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    assert best.outputs[0].logprobs is None  # ranking does not turn logprobs on
    assert len({tuple(c.token_ids) for c in all4.outputs}) > 1, "the samples should differ"
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks


def test_beam_search_abort_frees_every_block(llm: LLM) -> None:
    eng = llm.engine
    params = SamplingParams(n=4, temperature=0.0, use_beam_search=True, max_tokens=50)
    req = eng.add_request(list(range(20, 60)), params)
    for _ in range(5):
        assert not [o for o in eng.step() if o.request_id == req.request_id]  # nothing streamed
    assert eng.core.kv.num_free_blocks < eng.core.kv.num_blocks
    eng.abort(req.request_id)
    outs = [o for o in eng.step() if o.request_id == req.request_id]
    assert outs and outs[-1].finished
    assert {c.finish_reason for c in outs[-1].outputs} == {"abort"}
    eng.core.kv.check_integrity()
    assert eng.core.kv.num_free_blocks == eng.core.kv.num_blocks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"best_of": 1, "n": 2}, "best_of must be between n (2)"),
        ({"best_of": 99}, "best_of must be between n (1) and 16"),
        ({"best_of": 2, "temperature": 0.0}, "best_of > 1 with greedy sampling"),
        ({"use_beam_search": True}, "beam search is deterministic: set temperature=0"),
        ({"use_beam_search": True, "temperature": 0, "early_stopping": "soon"}, "early_stopping"),
        ({"use_beam_search": True, "temperature": 0, "early_stopping": 1}, "early_stopping"),
        ({"use_beam_search": True, "temperature": 0, "logprobs": 2}, "logprobs"),
        ({"use_beam_search": True, "temperature": 0, "stop": ["a"]}, "stop strings"),
        ({"use_beam_search": True, "temperature": 0, "min_p": 0.1}, "top_k, top_p or min_p"),
        ({"use_beam_search": True, "temperature": 0, "repetition_penalty": 1.2}, "penalties"),
        (
            {"use_beam_search": True, "temperature": 0, "length_penalty": float("nan")},
            "length_penalty",
        ),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        SP(**kwargs).validate(vocab_size=100, max_n=16, max_logprobs=20)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_beam_search_refuses_structured_outputs_and_wide_beams(llm: LLM) -> None:
    from engine.sample.structured.spec import ResponseFormat

    p = SamplingParams(
        temperature=0.0, use_beam_search=True, response_format=ResponseFormat.json_object()
    )
    with pytest.raises(ValueError, match="structured outputs"):
        llm.generate("hi", p)
    wide = LLM(
        llm.engine.core.config.model.path, dtype="float32", num_device_blocks=64, max_num_seqs=4
    )
    with pytest.raises(ValueError, match="beam width 8 exceeds"):
        wide.generate("hi", SamplingParams(n=8, temperature=0.0, use_beam_search=True))


def test_a_beam_group_that_outgrows_the_pool_fails_as_one(tiny_llama_path: Path) -> None:
    small = LLM(str(tiny_llama_path), dtype="float32", block_size=16, num_device_blocks=10)
    params = SamplingParams(
        n=4, temperature=0.0, use_beam_search=True, max_tokens=60, ignore_eos=True
    )
    # 100 prompt tokens (7 blocks) fit; four beams of 60 more tokens each cannot.
    (out,) = small.generate(list(range(30, 130)), params)
    assert out.finished and out.error is not None and "KV cache" in out.error
    assert {c.finish_reason for c in out.outputs} == {"error"}
    small.engine.core.kv.check_integrity()
    assert small.engine.core.kv.num_free_blocks == small.engine.core.kv.num_blocks
    assert not small.engine.has_unfinished_requests()
