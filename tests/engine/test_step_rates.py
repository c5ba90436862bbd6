"""The measured step costs a replica publishes for the cost policy."""

from __future__ import annotations

import pytest

from engine.step_rates import StepRates


def test_rates_follow_steps() -> None:
    r = StepRates(alpha=0.5)
    assert (r.decode_seq_s, r.prefill_tokens_per_s) == (0.0, 0.0)
    r.observe(0, 4, 0.04)  # decode only: 10 ms a sequence
    assert r.decode_seq_s == pytest.approx(0.01)
    r.observe(1000, 4, 0.54)  # 0.04 s of it is the decodes: 1000 tokens in 0.5 s
    assert r.prefill_tokens_per_s == pytest.approx(2000.0)
    r.observe(1000, 0, 0.25)  # 4000 tokens/s, averaged with weight 0.5
    assert r.prefill_tokens_per_s == pytest.approx(3000.0)
    r.observe(0, 0, 0.1)  # an empty step says nothing
    assert r.decode_seq_s == pytest.approx(0.01)


def test_engine_publishes_load_in_tokens(tiny_llama_path: object) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_llama_path), block_size=16, num_device_blocks=64)
    eng = llm.engine
    eng.add_request(list(range(10, 74)), SamplingParams(max_tokens=4, ignore_eos=True))
    s = eng.get_stats()
    assert (s.queued_prefill_tokens, s.num_decoding, s.active_tokens) == (64, 0, 0)
    assert s.step_tokens == eng.config.scheduler.max_num_batched_tokens
    eng.step()
    s = eng.get_stats()
    assert (s.queued_prefill_tokens, s.num_decoding) == (0, 1)
    assert s.active_tokens >= 64 and s.prefill_tokens_per_s > 0
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.get_stats().decode_seq_s > 0


def test_utilisation_decays_with_time() -> None:
    r = StepRates(window_s=10.0)
    for i in range(200):  # busy half the time for 100 s
        r.observe(0, 1, 0.25, now=i * 0.5 + 0.25)
    assert r.utilisation(100.0) == pytest.approx(0.5, abs=0.03)
    assert r.utilisation(110.0) == pytest.approx(0.5 / 2.718, abs=0.03)  # one time constant idle
