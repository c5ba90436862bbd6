"""The measured step costs a replica publishes for the cost policy."""

from __future__ import annotations

import random

import pytest

from engine.core.step_rates import StepRates


def _steps(overhead: float, per_token: float, per_seq: float, n: int, seed: int) -> list:
    """`n` steps of random mixes (prefill-only, decode-only, both) from a known cost, +-3 %."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = rng.choice(("prefill", "decode", "mixed"))
        p = 0 if kind == "decode" else rng.randint(16, 2048)
        b = 0 if kind == "prefill" else rng.randint(1, 16)
        s = overhead + per_token * p + per_seq * b
        out.append((p, b, s * rng.uniform(0.97, 1.03)))
    return out


def test_rates_recover_the_step_cost() -> None:
    r = StepRates()
    assert (r.decode_seq_s, r.prefill_tokens_per_s, r.overhead_s) == (0.0, 0.0, 0.0)
    for p, b, s in _steps(0.05, 0.0026, 0.0045, 400, seed=1):
        r.observe(p, b, s)
    assert r.overhead_s == pytest.approx(0.05, rel=0.15)
    assert r.prefill_tokens_per_s == pytest.approx(1 / 0.0026, rel=0.05)
    assert r.decode_seq_s == pytest.approx(0.0045, rel=0.15)
    r.observe(0, 0, 0.1)  # an empty step says nothing
    assert r.decode_seq_s == pytest.approx(0.0045, rel=0.15)


def test_rates_do_not_depend_on_the_batch_mix() -> None:
    """The first version charged the step overhead to the decodes: one replica decoding one
    sequence a step and another decoding eight published rates 3x apart on the same cost."""
    small, large = StepRates(), StepRates()
    for i in range(300):
        small.observe(
            256 if i % 4 == 0 else 0, 1, 0.05 + 0.0026 * (256 if i % 4 == 0 else 0) + 0.0045
        )
        large.observe(
            256 if i % 4 == 0 else 0, 8, 0.05 + 0.0026 * (256 if i % 4 == 0 else 0) + 0.036
        )
    assert small.prefill_tokens_per_s == pytest.approx(large.prefill_tokens_per_s, rel=0.02)
    assert small.prefill_tokens_per_s == pytest.approx(1 / 0.0026, rel=0.02)


def test_rates_follow_a_change_in_cost() -> None:
    r = StepRates()
    for p, b, s in _steps(0.05, 0.0026, 0.0045, 200, seed=2):
        r.observe(p, b, s)
    for p, b, s in _steps(0.05, 0.0052, 0.0045, 200, seed=3):  # prefill got twice as slow
        r.observe(p, b, s)
    assert r.prefill_tokens_per_s == pytest.approx(1 / 0.0052, rel=0.08)


def test_engine_publishes_load_in_tokens(tiny_llama_path: object) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_llama_path), block_size=16, num_device_blocks=64)
    eng = llm.engine
    eng.add_request(list(range(10, 74)), SamplingParams(max_tokens=4, ignore_eos=True))
    s = eng.get_stats()
    assert (s.queued_prefill_tokens, s.num_decoding, s.active_tokens) == (64, 0, 0)
    assert s.step_tokens == eng.core.config.scheduler.max_num_batched_tokens
    eng.step()
    s = eng.get_stats()
    assert (s.queued_prefill_tokens, s.num_decoding) == (0, 1)
    assert s.active_tokens >= 64 and s.prefill_tokens_per_s > 0
    while eng.has_unfinished_requests():
        eng.step()
    # NOTE: how the tiny model's step time splits between overhead and decodes is noise;
    # the fit's accuracy is checked on known costs above.
    assert (eng.core.step_rates.prefill_steps, eng.core.step_rates.decode_steps) == (1, 3)
    assert eng.get_stats().decode_seq_s >= 0
    # A waiting request counts only what the device tier does not hold for it: the first
    # prompt's 4 full blocks are cached.
    eng.add_request(list(range(10, 74)) + [5] * 20, SamplingParams(max_tokens=1))
    assert eng.get_stats().queued_prefill_tokens == 84 - 64


def test_utilisation_decays_with_time() -> None:
    r = StepRates(window_s=10.0)
    for i in range(200):  # busy half the time for 100 s
        r.observe(0, 1, 0.25, now=i * 0.5 + 0.25)
    assert r.utilisation(100.0) == pytest.approx(0.5, abs=0.03)
    assert r.utilisation(110.0) == pytest.approx(0.5 / 2.718, abs=0.03)  # one time constant idle


def test_count_busy_accumulates_whole_steps_undecayed() -> None:
    r = StepRates()
    r.observe(0, 4, 0.01, 0.0)  # the fit's part of a step is not the count
    assert (r.total_busy_s, r.total_steps) == (0.0, 0)
    r.count_busy(0.02)
    r.count_busy(0.03)
    assert r.total_busy_s == pytest.approx(0.05)
    assert r.total_steps == 2
