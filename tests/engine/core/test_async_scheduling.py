"""Async scheduling (EngineConfig.async_scheduling): a step is launched before the last one's
sampled ids are read, and every output is the same as with one step at a time.

On the CPU nothing overlaps (torch runs each op as it is called), so these tests check the
bookkeeping the GPU relies on: pending tokens gathered from the step in flight, positions counted
ahead, samples that end while a token is in flight, the fallback to waiting for rows that read the
output so far, and every block freed at the end. Each test also checks that steps were in fact
left in flight, so it cannot pass with the mode silently off.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.sample.structured import ResponseFormat
from tests.engine.test_parity import CONFIGS, hf_greedy, shared_prefix_prompts


class _Overlap:
    """Counts the steps whose results were read after a later step was launched."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.engine.core.runner
        self.launches = 0
        self.deferred = 0
        launch, collect = runner.launch, runner.collect
        seen: dict[int, int] = {}

        def counted_launch(*args: Any, **kwargs: Any) -> Any:
            handle = launch(*args, **kwargs)
            self.launches += 1
            seen[id(handle)] = self.launches
            return handle

        def counted_collect(handle: Any) -> Any:
            if seen.pop(id(handle), self.launches) < self.launches:
                self.deferred += 1
            return collect(handle)

        runner.launch = counted_launch  # type: ignore[method-assign]
        runner.collect = counted_collect  # type: ignore[method-assign]

        self.tokens = 0
        """Tokens scheduled in all (computed, whether or not their sample was still on)."""
        scheduler = llm.engine.core.scheduler
        schedule = scheduler.schedule

        def counted_schedule() -> Any:
            out = schedule()
            self.tokens += out.num_tokens
            return out

        scheduler.schedule = counted_schedule  # type: ignore[method-assign]


def _llm(path: Path, async_scheduling: bool, **cfg: Any) -> tuple[LLM, _Overlap]:
    cfg = {"dtype": "float32", "block_size": 16, **cfg}
    llm = LLM(str(path), async_scheduling=async_scheduling, **cfg)
    assert llm.engine.core.async_scheduling is async_scheduling
    return llm, _Overlap(llm)


def _settled(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    eng.core.kv.check_integrity()
    assert eng.core.kv.num_free_blocks == eng.core.kv.num_blocks
    for seqs in (eng.core.scheduler.running, list(eng.core.scheduler.waiting)):
        assert not seqs


def _outputs(outs: list[Any]) -> list[tuple[Any, ...]]:
    """Each completion's exact parts, and its logprobs (floats: compared within a tolerance, as
    the batches' shapes differ between the modes)."""
    return [
        tuple(
            (
                (c.token_ids, c.finish_reason, c.stop_reason, c.text),
                [
                    (lp.token_id, lp.logprob, [t for t, _ in lp.top], [v for _, v in lp.top])
                    for lp in c.logprobs or []
                ],
                c.cumulative_logprob,
            )
            for c in o.outputs
        )
        for o in outs
    ]


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    for (exact_a, lps_a, cum_a), (exact_b, lps_b, cum_b) in zip(a, b, strict=True):
        if exact_a != exact_b or len(lps_a) != len(lps_b) or (cum_a is None) != (cum_b is None):
            return False
        if cum_a is not None and cum_a != pytest.approx(cum_b, abs=1e-4):
            return False
        for (t_a, lp_a, ids_a, vals_a), (t_b, lp_b, ids_b, vals_b) in zip(
            lps_a, lps_b, strict=True
        ):
            if t_a != t_b or ids_a != ids_b or lp_a != pytest.approx(lp_b, abs=1e-4):
                return False
            if vals_a != pytest.approx(vals_b, abs=1e-4):
                return False
    return True


def _both(
    path: Path, prompts: list[Any], params: Any, **cfg: Any
) -> tuple[list[Any], _Overlap, _Overlap]:
    """Outputs of a sync and an async engine (asserted equal), then the two engines' counts."""
    results = []
    counts = []
    for mode in (False, True):
        llm, overlap = _llm(path, mode, **cfg)
        results.append(_outputs(llm.generate(prompts, params)))
        _settled(llm)
        counts.append(overlap)
    assert counts[0].deferred == 0
    for i, (a, b) in enumerate(zip(*results, strict=True)):
        assert _same(a, b), f"prompt {i}: sync {a} != async {b}"
    return results[1], counts[0], counts[1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_parity_with_transformers(tiny_llama_path: Path, name: str) -> None:
    """float32 greedy, token for token with transformers, with prefix caching, chunked prefill
    and preemption in play."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_path).vocab_size
    prompts = shared_prefix_prompts(vocab, 16, 600, seed=1)
    expected = hf_greedy(tiny_llama_path, prompts, 12)
    llm, overlap = _llm(tiny_llama_path, True, **CONFIGS[name])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    _settled(llm)
    assert overlap.deferred > 0
    if name == "preempt":
        assert llm.engine.get_stats().num_preemptions > 0


def test_samples_ending_while_a_token_is_in_flight(tiny_llama_path: Path) -> None:
    """Stop tokens, stop strings, max_tokens and max_model_len end samples while the next step
    (which computed one more token for them) is in flight; seeded sampling with logprobs stays
    the same draw for draw."""
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 200) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    params = []
    for i in range(12):
        params.append(
            SamplingParams(
                temperature=0.0 if i % 3 == 0 else 0.9,
                top_p=0.9 if i % 3 == 1 else 1.0,
                seed=100 + i if i % 3 else None,
                max_tokens=[3, 9, 40, None][i % 4],
                stop_token_ids=[rng.randrange(10, 200) for _ in range(8)] if i % 2 else [],
                stop=["e"] if i % 5 == 0 else [],
                logprobs=2 if i % 4 == 1 else None,
                ignore_eos=i % 2 == 0,
            )
        )
    outs, sync, asyn = _both(
        tiny_llama_path, prompts, params, max_model_len=48, num_device_blocks=64
    )
    assert asyn.deferred > 0
    reasons = [c[0][1] for o in outs for c in o]
    assert {"length", "stop"} <= set(reasons)
    # A sample that stops had one more token computed in the step in flight; one that ends by
    # length never does (max_tokens and max_model_len are known ahead).
    assert sync.tokens < asyn.tokens <= sync.tokens + reasons.count("stop")


def test_rows_that_read_their_output_wait_for_it(tiny_llama_path: Path) -> None:
    """Penalties, min_tokens, n > 1, best_of, a grammar and beam search beside plain samples:
    the steps they are in wait for their results (the mode falls back), and every output is
    the same as with one step at a time."""
    rng = random.Random(9)
    prompts = [[rng.randrange(10, 200) for _ in range(rng.randrange(4, 30))] for _ in range(9)]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [
        plain,
        SamplingParams(temperature=0.7, seed=1, max_tokens=20, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=20, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10),
        SamplingParams(temperature=0.8, seed=2, n=2, max_tokens=16),
        SamplingParams(temperature=0.8, seed=3, n=2, best_of=3, max_tokens=16),
        SamplingParams(max_tokens=16, response_format=ResponseFormat.regex("[a-c]{3,8}")),
        SamplingParams(n=2, temperature=0.0, use_beam_search=True, max_tokens=10),
        plain,
    ]
    _both(tiny_llama_path, prompts, params, num_device_blocks=256)
    # the same plain requests alone: every decode step is left in flight
    _, sync, asyn = _both(tiny_llama_path, [prompts[0], prompts[8]], plain)
    assert asyn.deferred >= 20
    assert asyn.tokens == sync.tokens


def test_swap_preemption_and_the_cpu_tier(tiny_llama_path: Path) -> None:
    """Swap preemption (the KV of a sequence with a token in flight goes to the CPU tier and
    comes back) and prefix hits from the CPU tier, with a pool too small for every sequence."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_path).vocab_size
    prompts = shared_prefix_prompts(vocab, 12, 300, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cfg = dict(num_device_blocks=40, num_cpu_blocks=200, max_num_batched_tokens=128)
    _, _, asyn = _both(tiny_llama_path, prompts + prompts, params, **cfg)
    assert asyn.deferred > 0
    _, _, asyn = _both(tiny_llama_path, prompts, params, preemption_mode="swap", **cfg)
    assert asyn.deferred > 0


def test_abort_while_a_step_is_in_flight(tiny_llama_path: Path) -> None:
    """An abort between steps, with the request's next token in flight, frees its blocks; the
    token that arrives after it is dropped and the other requests go on unchanged."""
    prompts = [[11 + i, 40, 41, 42, 43 + i] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    results = []
    for mode in (False, True):
        llm, overlap = _llm(tiny_llama_path, mode)
        eng = llm.engine
        ids = [eng.add_request(p, params).request_id for p in prompts]
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        reasons: dict[str, str | None] = {}
        steps = 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                got[out.request_id] += out.outputs[0].token_ids
                if out.finished:
                    reasons[out.request_id] = out.outputs[0].finish_reason
            steps += 1
            if steps == 6:
                if mode:
                    assert eng.core._in_flight is not None  # a token of every request is in flight
                assert eng.abort(ids[1])
        _settled(llm)
        assert reasons[ids[1]] == "abort"
        assert (overlap.deferred > 0) is mode
        results.append(([got[rid] for rid in ids], [reasons[rid] for rid in ids]))
    (sync_tokens, sync_reasons), (async_tokens, async_reasons) = results
    for i in (0, 2, 3):
        assert async_tokens[i] == sync_tokens[i]
        assert len(async_tokens[i]) == 30 and async_reasons[i] == sync_reasons[i] == "length"
    # an async engine reports each step's tokens one call later: it aborted a token earlier
    assert 0 < len(async_tokens[1]) < 30
    assert async_tokens[1] == sync_tokens[1][: len(async_tokens[1])]


def test_full_blocks_are_cached_as_without_it(tiny_llama_path: Path) -> None:
    """A token in flight that completes a block: the block is cached when the token arrives (the
    step after computed its KV), even when the sample ends there and is never scheduled again."""
    prompt = list(range(20, 50))  # 30 tokens: the 2nd output token completes block 2
    cached = []
    for mode in (False, True):
        llm, overlap = _llm(tiny_llama_path, mode)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0]
        _settled(llm)
        assert len(prompt + out.token_ids) == 33
        cached.append(len(llm.engine.core.kv.pool.cached))
        assert (overlap.deferred > 0) is mode
    assert cached[0] == cached[1] == 2


def test_a_prompt_pin_survives_preemption_with_its_first_token_in_flight(
    tiny_llama_path: Path,
) -> None:
    """pin_ttl_s pins the prompt's blocks when its first token arrives; under async scheduling the
    sequence may have been preempted (its blocks freed, still cached) by then: the pin finds the
    blocks by their hashes."""
    from engine.core.scheduler import SchedulerOutput

    pins = []
    for mode in (False, True):
        llm, _ = _llm(tiny_llama_path, mode)
        eng = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=8, pin_ttl_s=60)
        req = eng.add_request(list(range(20, 60)), params)  # 40 tokens: 2 full blocks
        eng.step()  # the prefill; async: its first token is in flight
        seq = req.seqs[0]
        if mode:
            assert seq.num_pending == 1
        # what a short pool does to the newest running sequence at the next schedule
        eng.core.scheduler._preempt(seq, SchedulerOutput())
        eng.step()
        pins.append(len(eng.core.kv.pins))
        assert req.pinned
        while eng.has_unfinished_requests():
            eng.step()
    assert pins == [2, 2]
