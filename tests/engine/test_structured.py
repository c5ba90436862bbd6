"""Structured outputs: the spec, the bitmask op, and constrained generation on real models."""

from __future__ import annotations

import math
import pickle
import re
import threading
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured import ResponseFormat
from engine.structured.bitmask import apply_bitmask, fill_bitmask
from engine.structured.compiler import validate_response_format
from tests.engine.structured_cases import (
    CHOICES,
    REGEX,
    SCHEMAS,
    check_json,
    check_regex,
    prompt_for,
)


# -- the spec ------------------------------------------------------------------------------------
def test_response_format_checks_its_shape() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        ResponseFormat("xml", "x")
    with pytest.raises(ValueError, match="at least one choice"):
        ResponseFormat.choice([])
    with pytest.raises(ValueError, match="non-empty spec"):
        ResponseFormat.regex("")
    with pytest.raises(ValueError, match="takes no spec"):
        ResponseFormat("json_object", "{}")


def test_response_format_key_and_pickle() -> None:
    a = ResponseFormat.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    b = ResponseFormat.json_schema({"properties": {"a": {"type": "string"}}, "type": "object"})
    assert a.key == b.key  # dicts are serialized with sorted keys
    assert a.key != ResponseFormat.regex("a").key
    params = SamplingParams(response_format=a)
    assert pickle.loads(pickle.dumps(params)).response_format == a


def test_response_format_from_pydantic() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):  # type: ignore[name-defined,misc]
        name: str
        count: int

    fmt = ResponseFormat.json_schema(Item)
    assert '"count"' in fmt.spec and fmt.kind == "json_schema"


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        (ResponseFormat("json_schema", '{"type": "objectx"}'), 'Unsupported type "objectx"'),
        (ResponseFormat("json_schema", '{"type":'), "Failed to parse JSON"),
        (ResponseFormat.regex("a(b"), "parenthesis is not closed"),
        (ResponseFormat.grammar('root ::= "a" | '), "EBNF parser error"),
    ],
)
def test_bad_spec_raises_the_compilers_message(fmt: ResponseFormat, message: str) -> None:
    with pytest.raises(ValueError, match=f"invalid {fmt.kind}: .*{message}") as info:
        validate_response_format(fmt)
    assert ".cc:" not in str(info.value)  # xgrammar's source location is stripped


# -- the bitmask op ------------------------------------------------------------------------------
def test_apply_bitmask_matches_a_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 100
    allowed = torch.rand((3, vocab), generator=gen) < 0.3  # [B, V]
    allowed[2] = True  # an unconstrained row
    words = -(-vocab // 32)
    padded = torch.zeros((3, words * 32), dtype=torch.bool)
    padded[:, :vocab] = allowed
    padded[2] = True
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    packed = (padded.view(3, words, 32).to(torch.int64) * weights).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    logits = torch.randn((3, vocab), generator=gen)
    expected = logits.masked_fill(~allowed, float("-inf"))
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


def test_fill_bitmask_none_without_constrained_rows() -> None:
    assert fill_bitmask([None, None], 64) is None


# -- generation on the tiny model (small BPE vocabulary) -----------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama_path: Path) -> LLM:
    return LLM(str(tiny_llama_path), num_device_blocks=512, max_num_batched_tokens=1024)


def _run_schemas(llm: LLM, temperature: float, max_tokens: int) -> tuple[int, int]:
    params = [
        SamplingParams(
            n=2,
            temperature=temperature,
            seed=7 if temperature else None,
            max_tokens=max_tokens,
            response_format=ResponseFormat.json_schema(s),
        )
        for s in SCHEMAS
    ]
    outs = llm.generate([prompt_for(s) for s in SCHEMAS], params)
    finished = total = 0
    for schema, out in zip(SCHEMAS, outs, strict=True):
        assert len(out.outputs) == 2
        for c in out.outputs:
            total += 1
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                finished += 1
                check_json(c.text, schema)
    return finished, total


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ten_schemas_validate_on_tiny_model(llm: LLM, temperature: float) -> None:
    finished, total = _run_schemas(llm, temperature, max_tokens=160)
    assert total == 20
    assert finished >= total // 2, f"only {finished}/{total} finished"


def test_regex_and_choice_on_tiny_model(llm: LLM) -> None:
    regex = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40)
    regex.response_format = ResponseFormat.regex(REGEX)
    choice = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=40)
    choice.response_format = ResponseFormat.choice(CHOICES)
    greedy_choice = SamplingParams(temperature=0.0, max_tokens=40)
    greedy_choice.response_format = ResponseFormat.choice(CHOICES)
    outs = llm.generate(["a", "b", "c"], [regex, choice, greedy_choice])
    for c in outs[0].outputs:
        assert c.finish_reason == "stop"
        check_regex(c.text)
    for c in outs[1].outputs + outs[2].outputs:
        assert c.finish_reason == "stop"
        assert c.text in CHOICES


def test_structured_with_logprobs_and_stop_string(llm: LLM) -> None:
    fmt = ResponseFormat.json_schema(SCHEMAS[0])
    out = llm.generate("x", SamplingParams(temperature=0.0, max_tokens=80, response_format=fmt))
    with_lp = llm.generate(
        "x", SamplingParams(temperature=0.0, max_tokens=80, logprobs=2, response_format=fmt)
    )[0]
    assert with_lp.outputs[0].token_ids == out[0].outputs[0].token_ids
    assert with_lp.outputs[0].logprobs is not None
    assert len(with_lp.outputs[0].logprobs) == len(with_lp.outputs[0].token_ids)
    # Taken after the grammar's mask: no top alternative is a token the grammar forbids (-inf).
    for lp in with_lp.outputs[0].logprobs:
        assert math.isfinite(lp.logprob) and all(math.isfinite(v) for _, v in lp.top)
    # A stop string inside the constrained text ends it early, as for unconstrained output.
    cut = llm.generate(
        "x",
        SamplingParams(temperature=0.0, max_tokens=80, stop=['"age"'], response_format=fmt),
    )[0].outputs[0]
    if '"age"' in out[0].outputs[0].text:
        assert cut.finish_reason == "stop" and cut.stop_reason == '"age"'
        assert out[0].outputs[0].text.startswith(cut.text)


def test_min_tokens_past_the_grammar_end_fails_the_request(llm: LLM) -> None:
    """min_tokens still bans EOS: once the grammar can only end, no token is left (documented in
    the proto's response_format comment)."""
    fmt = ResponseFormat.choice(["yes", "no"])
    params = SamplingParams(temperature=0.0, min_tokens=10, max_tokens=16, response_format=fmt)
    out = llm.generate("x", params)[0]
    assert out.outputs[0].finish_reason == "error"
    assert out.error is not None and "min_tokens or stop_token_ids conflict" in out.error


def test_length_ends_with_partial_text(llm: LLM) -> None:
    fmt = ResponseFormat.json_schema(SCHEMAS[2])
    out = llm.generate("x", SamplingParams(temperature=0.0, max_tokens=3, response_format=fmt))
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    assert c.text.startswith("{")


def test_bad_schema_is_rejected_before_queueing(llm: LLM) -> None:
    bad = SamplingParams(response_format=ResponseFormat("json_schema", '{"type": "objectx"}'))
    with pytest.raises(ValueError, match="Unsupported type"):
        llm.generate(["a", "b"], [SamplingParams(), bad])
    assert not llm.engine.has_unfinished_requests()


def test_grammar_compiles_once_per_spec(llm: LLM) -> None:
    fmt = ResponseFormat.regex("[0-9]{3}x")
    before = llm.engine.get_stats().grammar_cache
    for _ in range(2):
        llm.generate("a", SamplingParams(max_tokens=8, temperature=0.0, response_format=fmt))
    after = llm.engine.get_stats().grammar_cache
    assert after.compiles == before.compiles + 1
    assert after.hits == before.hits + 1
    assert after.entries >= 1


def _gate_compiles(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds every grammar compile on the worker thread until the returned event is set."""
    gate = threading.Event()
    pool = llm.engine.grammars
    real = pool._compile

    def gated(fmt: ResponseFormat) -> object:
        assert gate.wait(30)
        return real(fmt)

    monkeypatch.setattr(pool, "_compile", gated)
    return gate


def test_compiling_request_does_not_block_others(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose grammar is still compiling is stepped over; the one behind it runs."""
    engine = llm.engine
    gate = _gate_compiles(llm, monkeypatch)
    fmt = ResponseFormat.regex("[a-z]{4}[0-9]{1,2}")
    slow = engine.add_request("a", SamplingParams(max_tokens=8, response_format=fmt))
    assert slow.waiting_for_grammar
    fast = engine.add_request("b", SamplingParams(max_tokens=4, temperature=0.0))
    while not fast.finished:
        engine.step()
    assert slow.waiting_for_grammar and slow.seqs[0].num_computed_tokens == 0
    gate.set()
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == slow.request_id:
                text += "".join(c.text for c in o.outputs)
    assert slow.seqs[0].finish_reason == "stop"
    assert re.fullmatch(r"[a-z]{4}[0-9]{1,2}", text), text


def test_abort_while_compiling(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    gate = _gate_compiles(llm, monkeypatch)
    fmt = ResponseFormat.regex("[a-z]{5}[0-9]{1,3}q")
    req = engine.add_request("a", SamplingParams(max_tokens=8, response_format=fmt))
    assert req.waiting_for_grammar
    assert engine.abort(req.request_id)
    engine.step()
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert req.seqs[0].finish_reason == "abort"
    assert not engine._grammar_waits or all(rid != req.request_id for rid in engine._grammar_waits)


def test_preempted_request_gives_the_same_output(tiny_llama_path: Path) -> None:
    """Recompute preemption keeps the generated tokens and the matcher: greedy output unchanged."""
    schema = {
        "type": "array",
        "items": {"type": "string", "pattern": "^[a-z]{3}$"},
        "minItems": 12,
        "maxItems": 12,
    }  # a long output (~70 tokens), so that sequences outgrow the tight pool
    fmt = ResponseFormat.json_schema(schema)
    prompts = [f"order {i} of {7 * i + 3}:" for i in range(6)]  # short, no shared prefix
    params = SamplingParams(temperature=0.0, max_tokens=120, response_format=fmt)
    roomy = LLM(str(tiny_llama_path), num_device_blocks=512)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    tight = LLM(str(tiny_llama_path), num_device_blocks=20, block_size=16)
    outs = tight.generate(prompts, params)
    assert tight.engine.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            check_json(o.outputs[0].text, schema)


# -- the demo model --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ten_schemas_validate_on_demo_model(demo_model_path: Path, temperature: float) -> None:
    llm = LLM(str(demo_model_path), num_device_blocks=512, max_num_batched_tokens=2048)
    finished, total = _run_schemas(llm, temperature, max_tokens=160)
    assert total == 20
    assert finished >= total - 2, f"only {finished}/{total} finished"


@pytest.mark.slow
def test_regex_and_choice_on_demo_model(demo_model_path: Path) -> None:
    llm = LLM(str(demo_model_path), num_device_blocks=256)
    test_regex_and_choice_on_tiny_model(llm)


def test_engine_close_stops_the_grammar_worker(tiny_llama_path: Path) -> None:
    llm = LLM(str(tiny_llama_path), num_device_blocks=64)
    fmt = ResponseFormat.choice(["yes", "no"])
    llm.generate("x", SamplingParams(temperature=0.0, max_tokens=4, response_format=fmt))
    executor = llm.engine.grammars._executor
    assert executor is not None
    workers = list(executor._threads)
    assert workers and all(t.is_alive() for t in workers)
    assert llm.engine.close() is True  # no disk tier: nothing to flush
    for t in workers:
        t.join(timeout=10)
        assert not t.is_alive()
    assert llm.engine.grammars._executor is None
