"""bench/sim/replay.py: a measured router run replayed in the simulator."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.sim.profile import CPU
from bench.sim.replay import (
    fit_busy_scale,
    format_comparison,
    measured_figures,
    model_for_replicas,
    model_from_fit,
    replay,
    router_settings,
    scaled,
    simulated_figures,
    trace_workload,
)
from bench.workload import Record, Session

BS = CPU.block_size


def _sessions() -> list[Session]:
    system = list(range(1000, 1000 + 4 * BS))
    return [Session(system, [[2000 + 40 * i + t] * 40 for t in range(3)], 8) for i in range(2)]


def _records(sessions: list[Session], gap_s: float = 30.0) -> list[Record]:
    """Each session's turns `gap_s` apart (session 1 starts 1 s after session 0), as a client
    measures them; the answers are made-up ids."""
    out = []
    for i, s in enumerate(sessions):
        history = list(s.prefix)
        for t, user in enumerate(s.turns, start=1):
            prompt = history + user
            answer = [3000 + 10 * i + t] * s.output_len
            out.append(
                Record(
                    i,
                    t,
                    len(prompt),
                    output_ids=answer,
                    ttft_s=0.5,
                    cached_tokens=0,
                    sent_at=100.0 + i + (t - 1) * gap_s,
                )
            )
            history = prompt + answer
    return out


def test_trace_rebuilds_each_prompt_with_the_measured_answers_at_the_send_times() -> None:
    sessions = _sessions()
    wl = trace_workload(sessions, _records(sessions))
    assert [s.session_id for s in wl.sessions] == ["s0", "s1"]
    s0 = wl.sessions[0]
    assert s0.growing
    assert [t.arrival for t in s0.turns] == [0.0, 30.0, 60.0]
    assert wl.sessions[1].turns[0].arrival == 1.0
    # turn 2 = system + user 1 + answer 1 + user 2
    assert s0.turns[1].prompt == (
        sessions[0].prefix + sessions[0].turns[0] + [3001] * 8 + sessions[0].turns[1]
    )
    assert s0.turns[1].output == [3002] * 8
    # every turn's prompt + answer is a prefix of the next prompt: one hash chain
    for a, b in zip(s0.turns, s0.turns[1:], strict=False):
        assert b.prompt[: len(a.prompt) + len(a.output)] == a.prompt + a.output


def test_trace_stops_a_session_at_its_first_failure_and_checks_the_workload() -> None:
    sessions = _sessions()
    recs = _records(sessions)
    recs[1].error = "UNAVAILABLE"  # session 0, turn 2
    wl = trace_workload(sessions, recs)
    assert [len(s.turns) for s in wl.sessions] == [1, 3]
    recs[4] = replace(recs[4], prompt_tokens=recs[4].prompt_tokens + 1)
    with pytest.raises(ValueError, match="not this workload's record"):
        trace_workload(sessions, recs)


def test_an_isolated_request_costs_its_modelled_prefill_and_later_turns_hit() -> None:
    """Requests far apart on one replica: turn 1's TTFT is the cost model's prefill of the
    whole prompt; later turns reuse the history's full blocks and are faster."""
    sessions = _sessions()[:1]
    model = replace(CPU, max_num_seqs=16)
    recs = _records(sessions, gap_s=120.0)
    sim, busy = replay(
        [(sessions, recs)],
        model=model,
        num_replicas=1,
        policy="cost",
        poll_interval_s=0.5,
        weights=None,
    )
    assert [r.turn for r in sim] == [0, 1, 2]
    assert busy >= sum(r.ttft_s for r in sim)  # each request's wait is its own steps here
    p = recs[0].prompt_tokens
    assert sim[0].ttft_s == pytest.approx(model.step_s(p, p * p / 2, 0, 0), rel=0.05)
    assert sim[0].cached_tokens == 0
    assert sim[1].cached_tokens >= (p // BS) * BS
    assert sim[1].ttft_s < sim[0].ttft_s
    real, simulated = measured_figures(recs), simulated_figures(sim)
    assert real.p50_s == pytest.approx(0.5) and real.requests == simulated.requests == 3
    text = format_comparison({"cost": (real, simulated)})
    assert "cost: simulated TTFT p50 within 25% of the measured:" in text


def test_replica_and_router_settings_come_from_the_bench_flags() -> None:
    m = model_for_replicas(CPU, "--max-num-seqs 16 --threads 1 --max-num-batched-tokens 512")
    assert (m.max_num_seqs, m.step_tokens, m.device_blocks) == (16, 512, CPU.device_blocks)
    assert model_for_replicas(CPU, "--num-device-blocks 99").device_blocks == 99
    # what `deja serve` itself would run with: its flags and defaults, other flags ignored
    from engine.config import SchedulerConfig

    plain = model_for_replicas(replace(CPU, max_num_seqs=3), "--block-size 32 --port 1")
    assert plain.max_num_seqs == SchedulerConfig().max_num_seqs and plain.block_size == 32
    poll, w = router_settings("--recompute-weight 3 --poll-interval 0.25", 0.5)
    assert poll == 0.25 and w.recompute_weight == 3.0
    assert router_settings("", 0.5)[0] == 0.5
    fit = {
        k: 0.001
        for k in (
            "step_overhead_s",
            "prefill_token_s",
            "prefill_pair_s",
            "decode_seq_s",
            "context_token_s",
        )
    }
    fitted = model_from_fit(fit, "test")
    assert fitted.prefill_token_s == 0.001 and fitted.device_blocks == CPU.device_blocks


def test_chat_text_turns_are_replayed_as_the_ids_the_replica_served() -> None:
    """With the history sent as chat text, the replica computed the template around it: the
    simulator gets those ids, each turn hashed on its own, and later turns still find the
    history's blocks."""
    sessions = _sessions()[:1]
    recs = _records(sessions, gap_s=120.0)

    def served(prompt: list[int]) -> list[int]:
        return [1, 2, 3, *prompt, 7, 8]

    wl = trace_workload(sessions, recs, served)
    s0 = wl.sessions[0]
    assert not s0.growing
    assert s0.turns[0].prompt == served(sessions[0].prefix + sessions[0].turns[0])
    sim, _ = replay(
        [(sessions, recs)],
        model=replace(CPU, max_num_seqs=16),
        num_replicas=1,
        policy="cost",
        poll_interval_s=0.5,
        weights=None,
        served_ids=served,
    )
    assert sim[0].prompt_tokens == recs[0].prompt_tokens + 5
    assert sim[1].cached_tokens >= ((recs[0].prompt_tokens + 3) // BS) * BS - BS


def test_chat_served_ids_renders_the_template_over_the_decoded_history() -> None:
    from bench.sim.replay import chat_served_ids

    class Tok:
        chat_template = "t"

        def apply_chat_template(self, messages, **kw):  # type: ignore[no-untyped-def]
            assert kw["add_generation_prompt"] and kw["tokenize"]
            return [1, *(ord(c) for c in messages[0]["content"]), 2]

    served = chat_served_ids(
        Tok(), lambda ids: [{"role": "user", "content": "".join(map(chr, ids))}]
    )
    assert served([104, 105]) == [1, 104, 105, 2]


def test_step_costs_scale_until_the_simulated_replicas_are_as_busy_as_the_measured() -> None:
    """The whole-replica scale: the replay's busy time at the fitted factor matches the
    measured busy time, and the factor multiplies every step cost (cache sizes unchanged)."""
    sessions = _sessions()
    recs = _records(sessions, gap_s=0.3)
    model = replace(CPU, max_num_seqs=16)

    def busy_at(factor: float) -> float:
        return replay(
            [(sessions, recs)],
            model=scaled(model, factor),
            num_replicas=2,
            policy="round_robin",
            poll_interval_s=0.5,
            weights=None,
        )[1]

    base = busy_at(1.0)
    factor = fit_busy_scale(busy_at, 1.6 * base)
    assert 1.5 < factor < 3.0  # dearer steps batch more: busy time grows slower than the costs
    assert busy_at(factor) == pytest.approx(1.6 * base, rel=0.03)
    double = scaled(model, 2.0)
    assert double.prefill_token_s == 2 * model.prefill_token_s
    assert double.step_overhead_s == 2 * model.step_overhead_s
    assert double.device_blocks == model.device_blocks
    assert fit_busy_scale(busy_at, 0.0) == 1.0  # nothing measured: the engine-only costs
