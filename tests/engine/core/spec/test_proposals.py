"""Prompt lookup, the per-tenant suffix corpus and the proposer's adaptive length."""

from __future__ import annotations

from typing import Any

from engine.config import SpeculativeConfig
from engine.core.sequence import Request, Sequence
from engine.core.spec.ngram import TokenIndex
from engine.core.spec.proposer import MAX_BACKOFF, Proposer
from engine.core.spec.suffix import SuffixCache
from engine.outputs import RequestMetrics
from engine.sample.sampling_params import SamplingParams


def test_lookup_takes_the_longest_match_then_the_most_recent() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3, 6, 0, 2, 3]
    index = TokenIndex(key_len=2)
    m = index.lookup(tokens, max_len=8, num_tokens=3)
    # "2 3" ends at 2, 6 and 11; none extends further back ("0 2 3" never occurred before), so
    # the most recent wins: what followed position 11.
    assert m is not None and m.length == 2 and m.continuation == [6, 0, 2]
    tokens += [4, 9]  # "... 2 3 4 9" now matches positions 0..4: the longer match wins
    m = index.lookup(tokens, max_len=8, num_tokens=3)
    assert m is not None and m.length == 4 and m.continuation == [2, 3, 5]


def test_lookup_needs_key_len_tokens_and_an_earlier_occurrence() -> None:
    index = TokenIndex(key_len=3)
    assert index.lookup([5, 6], 8, 4) is None
    assert index.lookup([5, 6, 7, 8, 9], 8, 4) is None  # "7 8 9" never occurred before
    m = index.lookup([5, 6, 7, 8, 5, 6, 7], 8, 4)
    assert m is not None and m.length == 3 and m.continuation == [8, 5, 6, 7]


def test_index_grows_with_the_tokens() -> None:
    tokens = [1, 2, 3, 1, 2]
    index = TokenIndex(key_len=2)
    assert index.lookup(tokens, 4, 2) == index.lookup(list(tokens), 4, 2)
    assert index.indexed == 4
    tokens += [3, 7, 1, 2]
    m = index.lookup(tokens, 4, 2)
    assert index.indexed == 8
    assert m is not None and m.length == 2 and m.continuation == [3, 7]


def test_suffix_cache_is_per_tenant_and_bounded() -> None:
    cache = SuffixCache(key_len=2, max_len=4, max_docs=2)
    cache.add(b"a", [100, 101, 102, 1, 2, 3, 4, 5], num_prompt_tokens=3)
    assert cache.lookup(b"b", [9, 1, 2], 3) is None
    m = cache.lookup(b"a", [9, 1, 2], 3)
    assert m is not None and m.continuation == [3, 4, 5]
    # The prompt's tail is kept too, so an output's first tokens follow the prompt's end.
    m = cache.lookup(b"a", [7, 101, 102], 2)
    assert m is not None and m.continuation == [1, 2]
    cache.add(b"a", [0, 0, 8, 8, 8], 2)
    cache.add(b"a", [0, 0, 6, 6, 6], 2)  # the oldest document goes
    assert cache.lookup(b"a", [9, 1, 2], 3) is None
    assert len(cache.tenants[b"a"].docs) == 2


def _seq(tokens: list[int], num_prompt: int, **params: Any) -> Sequence:
    req = Request(
        "r", tokens[:num_prompt], SamplingParams(**params), b"t", RequestMetrics(arrival=0.0)
    )
    return Sequence(0, req, 0, list(tokens), 16)


def test_proposals_shrink_back_off_and_grow() -> None:
    p = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    seq = _seq([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], 9)
    assert p.propose(seq, 10) == [3, 4, 5, 6]
    p.observe(seq, 4, 1)  # partly accepted: next at most 2
    assert p.propose(seq, 10) == [3, 4]
    p.observe(seq, 2, 0)  # fully rejected: halved
    assert p.propose(seq, 10) == [3]
    p.observe(seq, 1, 0)  # two in a row: it waits a step
    assert p.propose(seq, 10) == []
    assert p.propose(seq, 10) == [3]
    p.observe(seq, 1, 1)  # accepted: grows by one
    assert p.propose(seq, 10) == [3, 4]
    assert p.propose(seq, 1) == [3]  # never past what the scheduler allows
    s = p.stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 8, 2)
    assert s.accepted_per_pos == [2, 0, 0, 0]
    assert seq.request.metrics.num_accepted_tokens == 2


def test_backoff_is_capped() -> None:
    p = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    seq = _seq([1, 2, 3, 1, 2], 5)
    waits = []
    for _ in range(12):
        while not p.propose(seq, 4):
            pass
        p.observe(seq, 1, 0)
        assert seq.draft is not None
        waits.append(seq.draft.wait)
    assert max(waits) == MAX_BACKOFF


def test_requests_that_read_their_output_get_no_proposals() -> None:
    def req(**params: Any) -> Request:
        return Request("r", [1], SamplingParams(**params), b"", RequestMetrics(arrival=0.0))

    assert Proposer.eligible(req(temperature=0.7, logprobs=3, n=2, stop=["x"]))
    assert not Proposer.eligible(req(repetition_penalty=1.2))
    assert not Proposer.eligible(req(presence_penalty=0.5))
    assert not Proposer.eligible(req(n=2, use_beam_search=True, temperature=0.0))
    seq = _seq([1, 2, 1, 2], 3, min_tokens=3)
    p = Proposer(SpeculativeConfig(method="ngram", prompt_lookup_min=1))
    assert p.propose(seq, 4) == []  # under min_tokens, whose EOS mask reads the output
