from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from engine.sample.sampler import OutputTokens, Sampler, SamplingRow
from engine.sample.sampling_params import SamplingParams
from engine.sample.structured import ResponseFormat
from engine.sample.structured.bitmask import TokenMask, pack_allowed

V = 32
EOS = 3
CPU = torch.device("cpu")


def _row(
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
) -> SamplingRow:
    params = replace(params or SamplingParams(), seed=seed)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, prompt or [], output or [], gen)


def _logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


def _sample_many(
    logits_row: torch.Tensor, params: SamplingParams, n: int = 4000, seed: int = 0
) -> Counter[int]:
    """Token counts of n rows sharing one logits row (one call, shared generator)."""
    sampler = Sampler(V, CPU, seed)
    rows = [SamplingRow(params, [], [], None) for _ in range(n)]
    out = sampler(logits_row.expand(n, V).clone(), rows, [EOS])
    return Counter(out.token_ids)


def _reference_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Plain per-row, per-token version of vLLM's penalties."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        for t in set(r.prompt_token_ids) | set(r.output_token_ids):
            x = float(out[i, t])
            out[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t, c in Counter(r.output_token_ids).items():
            out[i, t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_greedy_is_argmax() -> None:
    logits = _logits(6)
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    out = Sampler(V, CPU, 0)(logits, rows, [EOS])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_padded_vocab_columns_are_ignored() -> None:
    logits = torch.cat([_logits(2), torch.full((2, 8), 100.0)], dim=1)
    rows = [_row(SamplingParams(temperature=0.0)), _row(SamplingParams(top_k=3))]
    out = Sampler(V, CPU, 0)(logits, rows, [EOS])
    assert all(t < V for t in out.token_ids)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=0.7, top_k=1, top_p=0.9),
        SamplingParams(temperature=1e-4),
    ],
    ids=["top_k=1", "tiny top_p", "min_p=1", "top_k=1+top_p", "tiny temperature"],
)
def test_degenerate_sampling_equals_greedy(params: SamplingParams) -> None:
    logits = _logits(64, seed=1)
    rows = [_row(params) for _ in range(64)]
    out = Sampler(V, CPU, 0)(logits, rows, [EOS])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_keeps_only_k_best() -> None:
    logits = _logits(1, seed=2)[0]
    counts = _sample_many(logits, SamplingParams(top_k=4), n=2000)
    allowed = set(logits.topk(4).indices.tolist())
    assert set(counts) == allowed


def test_top_p_keeps_the_nucleus() -> None:
    logits = _logits(1, seed=3)[0]
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True).tolist()
    # Smallest set of best tokens whose mass reaches 0.8.
    nucleus, mass = [], 0.0
    for t in order:
        nucleus.append(t)
        mass += float(probs[t])
        if mass >= 0.8:
            break
    counts = _sample_many(logits, SamplingParams(top_p=0.8), n=4000)
    assert set(counts) <= set(nucleus)
    assert len(counts) == len(nucleus)  # every nucleus token has mass >= 1/4000 here
    assert float(probs[nucleus[-1]]) > 1e-3


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.tensor([4.0, 3.5, 3.0, 1.0] + [0.0] * (V - 4))
    probs = logits.softmax(-1)
    counts = _sample_many(logits, SamplingParams(min_p=0.3), n=2000)
    kept = {t for t in range(V) if probs[t] >= 0.3 * probs.max()}
    assert kept == {0, 1, 2}
    assert set(counts) == kept


def test_samples_follow_softmax_and_temperature() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0] + [-30.0] * (V - 4))
    n = 8000
    for temperature in (0.5, 1.0, 2.0):
        counts = _sample_many(logits, SamplingParams(temperature=temperature), n=n, seed=7)
        expected = (logits / temperature).softmax(-1)
        for t in range(4):
            # ~4.5 standard deviations of a binomial frequency.
            p = float(expected[t])
            assert abs(counts[t] / n - p) < 4.5 * math.sqrt(p * (1 - p) / n) + 1e-3
        assert set(counts) <= {0, 1, 2, 3}
    cold = _sample_many(logits, SamplingParams(temperature=0.5), n=n, seed=8)[0]
    hot = _sample_many(logits, SamplingParams(temperature=2.0), n=n, seed=8)[0]
    assert cold > hot


def test_penalties_match_reference() -> None:
    rows = [
        _row(SamplingParams(repetition_penalty=1.7, logprobs=V), [1, 5, 5, 9], [9, 2, 2, 2]),
        _row(SamplingParams(frequency_penalty=0.6, logprobs=V), [4, 6], [6, 7, 7, 7, 0]),
        _row(SamplingParams(presence_penalty=-1.3, logprobs=V), [4, 6], [6, 7, 7, 31]),
        _row(
            SamplingParams(
                repetition_penalty=0.8,
                frequency_penalty=0.4,
                presence_penalty=1.1,
                logprobs=V,
                temperature=0.0,
            ),
            [10, 11, 12],
            [12, 13, 13, 20],
        ),
        _row(SamplingParams(logprobs=V), [1, 2, 3], [4, 5, 6]),
    ]
    logits = _logits(len(rows), seed=4)
    out = Sampler(V, CPU, 0)(logits, rows, [EOS])
    expected = torch.log_softmax(_reference_penalties(logits, rows), dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert lp is not None
        got = torch.full((V,), float("nan"))
        for t, v in lp.top:
            got[t] = v
        torch.testing.assert_close(got, expected[i], rtol=0, atol=1e-5)
    assert out.token_ids[3] == int(expected[3].argmax())
    # Unpenalized rows and tokens are untouched.
    torch.testing.assert_close(expected[4], torch.log_softmax(logits[4], -1))


def test_output_tokens_view_reads_like_the_list() -> None:
    tokens = [1, 5, 5, 9, 9, 2, 2, 2]
    view = OutputTokens(tokens, 4)
    assert len(view) == 4 and list(view) == [9, 2, 2, 2] and view[0] == 9 and view[1:] == [2, 2, 2]
    tokens.append(7)  # the sequence grows: the view sees it without being rebuilt
    assert len(view) == 5 and list(view)[-1] == 7
    # Penalties and min_tokens read a view as they read a list.
    params = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.5, min_tokens=6, logprobs=V)
    logits = _logits(1, seed=5)
    as_list = Sampler(V, CPU, 0)(logits, [_row(params, tokens[:4], tokens[4:])], [EOS])
    as_view = Sampler(V, CPU, 0)(logits, [_row(params, tokens[:4], view)], [EOS])  # type: ignore[arg-type]
    assert as_list == as_view


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(4, V)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 8] = 8.0
    greedy_stop = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], logprobs=0)
    rows = [
        _row(greedy_stop, output=[1, 1]),  # 2 < 3: EOS and 7 masked
        _row(greedy_stop, output=[1, 1, 1]),  # reached min_tokens: unmasked
        _row(SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)),  # EOS does not stop
        _row(SamplingParams(min_tokens=5, stop_token_ids=[7], top_k=1)),
    ]
    out = Sampler(V, CPU, 0)(logits, rows, [EOS])
    assert out.token_ids == [8, EOS, EOS, 8]
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == 8 and lp.top == []
    masked = logits[0].clone()
    masked[[EOS, 7]] = float("-inf")
    assert lp.logprob == pytest.approx(float(torch.log_softmax(masked, -1)[8]))


def _mask(allowed: dict[int, torch.Tensor], num_rows: int) -> TokenMask:
    """A TokenMask over the given rows (bool [V] allowed each); the other rows are free."""
    rows = sorted(allowed)
    packed = torch.from_numpy(np.stack([pack_allowed(allowed[r].numpy()) for r in rows]))
    index = None if len(rows) == num_rows else torch.tensor(rows)
    return TokenMask(rows=index, packed=packed, banned=None)


def test_min_tokens_gives_way_to_a_grammar_that_can_only_end() -> None:
    """A constrained row whose grammar allows only EOS (or only banned stop ids) takes it below
    min_tokens; a constrained row with another allowed token and free rows keep the ban."""
    logits = torch.zeros(5, V)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 8] = 8.0
    only = {t: torch.zeros(V, dtype=torch.bool) for t in (EOS, 7)}
    for t, a in only.items():
        a[t] = True
    eos_or_4 = torch.zeros(V, dtype=torch.bool)
    eos_or_4[[EOS, 4]] = True
    fmt = ResponseFormat.regex("x")  # any format: the sampler only looks at whether one is set
    grammar = SamplingParams(temperature=0.0, min_tokens=5, response_format=fmt, logprobs=0)
    stop7 = replace(grammar, stop_token_ids=[7])
    rows = [
        _row(grammar),  # grammar allows only EOS: EOS despite min_tokens
        _row(stop7),  # grammar allows only 7, a banned stop id: 7
        _row(grammar),  # grammar allows EOS or 4: the ban holds, 4
        _row(SamplingParams(temperature=0.0, min_tokens=5)),  # free: 7
        _row(SamplingParams(temperature=0.0, min_tokens=5, response_format=fmt)),  # no mask row
    ]
    mask = _mask({0: only[EOS], 1: only[7], 2: eos_or_4}, 5)
    out = Sampler(V, CPU, 0)(logits, rows, [EOS], mask=mask)
    assert out.token_ids == [EOS, 7, 4, 7, 7]
    lp = out.logprobs[0]
    assert lp is not None and lp.logprob == pytest.approx(0.0)  # EOS is all that is left


def _seeded_run(batches: Iterator[tuple[list[SamplingRow], int]]) -> list[int]:
    """Tokens of the row at the given position over several steps."""
    sampler = Sampler(V, CPU, 123)
    tokens = []
    for step, (rows, pos) in enumerate(batches):
        logits = _logits(len(rows), seed=100 + step)
        logits[pos] = _logits(1, seed=step)[0]  # the seeded row's logits
        tokens.append(sampler(logits, rows, [EOS]).token_ids[pos])
    return tokens


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.8, top_k=5), SamplingParams(top_p=0.9)],
    ids=["plain", "top_k", "top_p"],
)
def test_seeded_row_ignores_batch(params: SamplingParams) -> None:
    steps = 8

    def alone() -> Iterator[tuple[list[SamplingRow], int]]:
        row = _row(params, seed=42)
        for _ in range(steps):
            yield [row], 0

    def crowded(shift: int) -> Iterator[tuple[list[SamplingRow], int]]:
        row = _row(params, seed=42)
        others = [
            _row(SamplingParams(temperature=0.0)),
            _row(SamplingParams(top_p=0.5, min_p=0.1)),
            _row(SamplingParams(top_k=3), seed=7),
            _row(SamplingParams(repetition_penalty=1.3, logprobs=2), [1, 2], [3]),
        ]
        for step in range(steps):
            batch = others[: (step + shift) % 5]
            pos = (step * shift) % (len(batch) + 1)
            yield [*batch[:pos], row, *batch[pos:]], pos

    reference = _seeded_run(alone())
    assert len(set(reference)) > 1
    assert _seeded_run(crowded(1)) == reference
    assert _seeded_run(crowded(3)) == reference
    other_seed = _seeded_run(([_row(params, seed=43)], 0) for _ in range(steps))
    assert other_seed != reference


def test_logprobs_are_log_softmax_and_sorted() -> None:
    logits = _logits(3, seed=5)
    rows = [
        _row(SamplingParams(logprobs=5, temperature=0.7, top_k=3)),
        _row(SamplingParams(logprobs=0)),
        _row(SamplingParams(temperature=0.0)),
    ]
    out = Sampler(V, CPU, 0)(logits, rows, [EOS])
    expected = torch.log_softmax(logits, dim=-1)
    lp0, lp1 = out.logprobs[0], out.logprobs[1]
    assert lp0 is not None and lp1 is not None and out.logprobs[2] is None
    # Logprobs are of the model's distribution, before temperature and top-k.
    assert lp0.token_id == out.token_ids[0]
    assert lp0.logprob == pytest.approx(float(expected[0, out.token_ids[0]]), abs=1e-5)
    assert [t for t, _ in lp0.top] == expected[0].topk(5).indices.tolist()
    vals = [v for _, v in lp0.top]
    assert vals == sorted(vals, reverse=True)
    torch.testing.assert_close(torch.tensor(vals), expected[0].topk(5).values)
    assert lp1.top == []
    assert lp1.logprob == pytest.approx(float(expected[1, out.token_ids[1]]), abs=1e-5)


def test_logprobs_skip_tokens_a_grammar_forbids() -> None:
    """Logprobs are taken after the grammar's mask: forbidden tokens are never top alternatives."""
    logits = _logits(2, seed=9)
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[2, 5, 11]] = True
    rows = [_row(SamplingParams(logprobs=5)), _row(SamplingParams(logprobs=5))]
    out = Sampler(V, CPU, 0)(logits, rows, [EOS], mask=_mask({0: allowed}, 2))
    lp0, lp1 = out.logprobs
    assert lp0 is not None and lp1 is not None
    assert out.token_ids[0] in (2, 5, 11) and math.isfinite(lp0.logprob)
    masked = torch.full((V,), float("-inf"))
    masked[[2, 5, 11]] = logits[0, [2, 5, 11]]
    expected = torch.log_softmax(masked, -1)
    # Only the 3 allowed tokens, though 5 were asked for; they hold all the probability.
    assert [t for t, _ in lp0.top] == expected.topk(3).indices.tolist()
    assert sum(math.exp(v) for _, v in lp0.top) == pytest.approx(1.0)
    assert len(lp1.top) == 5  # an unconstrained row in the same batch is untouched


def test_one_host_sync_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    syncs = Counter[str]()
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: object, _n: str = name, _f: Any = original) -> Any:
            syncs[_n] += 1
            return _f(self, *a)

        monkeypatch.setattr(torch.Tensor, name, counted)
    rows = [
        _row(SamplingParams(temperature=0.0, logprobs=3)),
        _row(SamplingParams(top_k=4, top_p=0.9, min_p=0.05, logprobs=0), seed=1),
        _row(SamplingParams(repetition_penalty=1.2, presence_penalty=0.5), [1, 2], [2, 3]),
        _row(SamplingParams(min_tokens=4, top_k=2), output=[5]),
    ]
    Sampler(V, CPU, 0)(_logits(4), rows, [EOS])
    assert sum(syncs.values()) == 1, syncs


def test_empty_batch() -> None:
    out = Sampler(V, CPU, 0)(torch.empty(0, V), [], [EOS])
    assert out.token_ids == [] and out.logprobs == []


def test_batch_traits_follow_the_rows_from_step_to_step() -> None:
    """The traits are read once per distinct list of rows: a new row (or one left out) in the
    next batch is seen, and a min_tokens ban lifts once the row's outputs reach it."""
    sampler = Sampler(V, CPU, 0)
    logits = _logits(2)
    greedy = _row(SamplingParams(temperature=0.0))
    best = int(logits[1].argmax())
    output: list[int] = []
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[best])
    banned = SamplingRow(params, [], output, None)  # reads `output` as it grows
    # step 1: all greedy, nothing to change: the argmax, and the caller's logits untouched
    before = logits.clone()
    assert sampler(logits, [greedy, greedy], [EOS]).token_ids == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)
    # step 2: a row with min_tokens joins: its stop token is banned while it has no output
    out = sampler(logits, [greedy, banned], [EOS])
    assert out.token_ids[1] != best
    # step 3: the same rows, the row's output now reaches min_tokens: the ban lifts
    output.append(out.token_ids[1])
    assert sampler(logits, [greedy, banned], [EOS]).token_ids[1] == best
    # step 4: a row that asks for logprobs replaces it: they are reported
    with_lp = _row(SamplingParams(temperature=0.0, logprobs=0))
    out = sampler(logits, [greedy, with_lp], [EOS])
    assert out.logprobs[0] is None and out.logprobs[1] is not None
    # step 5: back to greedy rows only: no logprobs
    assert sampler(logits, [greedy, greedy], [EOS]).logprobs == [None, None]
