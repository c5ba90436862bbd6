"""Structured outputs: the spec, the bitmask op, and constrained generation on real models."""

from __future__ import annotations

import math
import pickle
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.core.sequence import Request
from engine.frontend.llm import LLM
from engine.sample.sampling_params import SamplingParams
from engine.sample.structured import ResponseFormat
from engine.sample.structured.bitmask import TokenMask, apply_token_mask, pack_allowed
from engine.sample.structured.compiler import validate_response_format
from tests.engine.sample.structured_cases import (
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


# -- the mask op ---------------------------------------------------------------------------------
def _reference_pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [B, V] -> int32 [B, W] by arithmetic (independent of pack_allowed's numpy)."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = torch.zeros((rows, words * 32), dtype=torch.bool)
    padded[:, :vocab] = allowed
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    packed = (padded.view(rows, words, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_pack_allowed_matches_a_reference() -> None:
    allowed = torch.rand((4, 100), generator=torch.Generator().manual_seed(1)) < 0.5
    packed = np.stack([pack_allowed(row.numpy()) for row in allowed])
    assert torch.equal(torch.from_numpy(packed), _reference_pack(allowed))


@pytest.mark.parametrize("host_unpacked", [False, True])
@pytest.mark.parametrize("subset", [False, True])
def test_apply_token_mask_matches_a_reference(host_unpacked: bool, subset: bool) -> None:
    """Masked rows get -inf where not allowed; rows outside `rows` stay untouched."""
    from engine.sample.structured.bitmask import unpack_banned

    gen = torch.Generator().manual_seed(0)
    vocab = 100
    allowed = torch.rand((4, vocab), generator=gen) < 0.3  # [B, V]
    logits = torch.randn((4, vocab), generator=gen)
    rows = [0, 2] if subset else [0, 1, 2, 3]
    expected = logits.clone()
    expected[rows] = logits[rows].masked_fill(~allowed[rows], float("-inf"))
    packed = _reference_pack(allowed[rows])
    banned = torch.from_numpy(unpack_banned(packed.numpy())).view(torch.bool)
    mask = TokenMask(
        rows=torch.tensor(rows) if subset else None,
        packed=packed,
        banned=banned if host_unpacked else None,
    )
    apply_token_mask(logits, mask)
    assert torch.equal(logits, expected)


def test_mask_filler_fills_copies_filters_and_skips_free_rows() -> None:
    """The worker's mask equals each matcher's own fill, ANDed with its filter; a matcher shared
    by two rows is copied; free rows get no mask row."""
    import xgrammar as xgr

    from engine.sample.structured.mask_filler import TokenMaskFiller

    vocab = ["a", "b", "c", "</s>"] + [f"t{i}" for i in range(60)]  # 64 tokens, W = 2
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[3])
    grammar = xgr.GrammarCompiler(info).compile_regex("ab*c")
    m0, m1 = xgr.GrammarMatcher(grammar), xgr.GrammarMatcher(grammar)
    assert m1.accept_token(0)  # "a": next is b, c
    keep = np.ones(64, dtype=bool)
    keep[2] = False  # the filter bans "c"
    token_filter = pack_allowed(keep)
    filler = TokenMaskFiller(64, unpack_on_host=True)
    try:
        assert filler.start([None, None], [None, None]) is None
        pending = filler.start([m0, None, m1, m1], [None, None, token_filter, None])
        assert pending is not None
        mask = pending.result()
    finally:
        filler.close()
    assert mask.rows is not None and mask.rows.tolist() == [0, 2, 3]
    expected = np.full((3, 2), -1, dtype=np.int32)
    m0.fill_next_token_bitmask(expected, 0)
    m1.fill_next_token_bitmask(expected, 1)
    m1.fill_next_token_bitmask(expected, 2)
    expected[1] &= token_filter
    assert np.array_equal(mask.packed.numpy(), expected)
    assert mask.banned is not None
    allowed = [set(np.flatnonzero(~mask.banned[r].numpy()).tolist()) for r in range(3)]
    assert allowed == [{0}, {1}, {1, 2}]  # "a" / "b" ("c" filtered) / "b", "c"


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


def test_min_tokens_past_a_choice_is_rejected_at_admission(llm: LLM) -> None:
    """A choice output has at most its longest choice's bytes in tokens: known before queueing."""
    fmt = ResponseFormat.choice(["yes", "no"])
    with pytest.raises(ValueError, match=r"min_tokens \(4\) cannot be met .* longest choice is 3"):
        llm.generate("x", SamplingParams(min_tokens=4, max_tokens=8, response_format=fmt))
    assert not llm.engine.has_unfinished_requests()
    ok = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8, response_format=fmt)
    assert llm.generate("x", ok)[0].outputs[0].text in ("yes", "no")


def test_min_tokens_past_the_grammar_end_stops_cleanly(llm: LLM) -> None:
    """Where admission cannot know (a regex), the grammar wins: the sample ends, valid, with
    finish reason "stop" and fewer than min_tokens tokens (documented in the proto)."""
    fmt = ResponseFormat.regex("(yes|no)")
    params = SamplingParams(temperature=0.0, min_tokens=10, max_tokens=16, response_format=fmt)
    out = llm.generate(
        ["x", "y"],
        [
            params,
            SamplingParams(
                temperature=1.0, seed=3, n=2, min_tokens=10, max_tokens=16, response_format=fmt
            ),
        ],
    )
    for o in out:
        assert o.error is None
        for c in o.outputs:
            assert c.finish_reason == "stop" and c.text in ("yes", "no")
            assert len(c.token_ids) < 10


def test_min_tokens_still_holds_while_the_grammar_can_go_on(llm: LLM) -> None:
    """EOS stays banned below min_tokens when the grammar allows more than its end."""
    fmt = ResponseFormat.regex("(ab)+")
    free = llm.generate("y", SamplingParams(temperature=0.0, max_tokens=40, response_format=fmt))
    short = free[0].outputs[0]
    assert short.finish_reason == "stop"  # the tiny model ends early here without min_tokens
    need = len(short.token_ids) + 3
    params = SamplingParams(temperature=0.0, min_tokens=need, max_tokens=40, response_format=fmt)
    c = llm.generate("y", params)[0].outputs[0]
    assert c.finish_reason in ("stop", "length") and re.fullmatch("(ab)+", c.text)
    assert len(c.token_ids) >= need


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


def _compiling_request(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, pattern: str
) -> tuple[Request, threading.Event]:
    """A request (max_tokens=8) constrained to `pattern` whose grammar compile is held on the
    worker thread until the returned event is set."""
    gate = threading.Event()
    pool = llm.engine.core.grammars
    real = pool._compile

    def gated(fmt: ResponseFormat) -> object:
        assert gate.wait(30)
        return real(fmt)

    monkeypatch.setattr(pool, "_compile", gated)
    fmt = ResponseFormat.regex(pattern)
    req = llm.engine.add_request("a", SamplingParams(max_tokens=8, response_format=fmt))
    assert req.waiting_for_grammar
    return req, gate


def test_compiling_request_does_not_block_others(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose grammar is still compiling is stepped over; the one behind it runs."""
    engine = llm.engine
    slow, gate = _compiling_request(llm, monkeypatch, "[a-z]{4}[0-9]{1,2}")
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
    req, gate = _compiling_request(llm, monkeypatch, "[a-z]{5}[0-9]{1,3}q")
    assert engine.abort(req.request_id)
    engine.step()
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert req.seqs[0].finish_reason == "abort"
    assert not engine.core._grammar_waits or all(
        rid != req.request_id for rid in engine.core._grammar_waits
    )


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


def test_engine_close_stops_the_grammar_and_mask_workers(tiny_llama_path: Path) -> None:
    llm = LLM(str(tiny_llama_path), num_device_blocks=64)
    fmt = ResponseFormat.choice(["yes", "no"])
    llm.generate("x", SamplingParams(temperature=0.0, max_tokens=4, response_format=fmt))
    executors = [llm.engine.core.grammars._executor, llm.engine.core.records.masks._executor]
    assert all(e is not None for e in executors)
    workers = [t for e in executors for t in e._threads]  # type: ignore[union-attr]
    assert len(workers) == 2 and all(t.is_alive() for t in workers)
    assert llm.engine.close() is True  # no disk tier: nothing to flush
    for t in workers:
        t.join(timeout=10)
        assert not t.is_alive()
    assert (
        llm.engine.core.grammars._executor is None
        and llm.engine.core.records.masks._executor is None
    )
