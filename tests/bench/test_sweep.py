"""`deja bench serve --sweep-concurrency`: the offline closed loop, and a whole sweep against a
spawned server vs the offline engine on the tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sweep import TARGET_RATIO, offline_closed_loop, parse_levels, sweep_rows
from bench.workload import DatasetSpec, Workload
from engine import LLM, SamplingParams
from service import cli

ENGINE_FLAGS = ["--num-device-blocks", "256", "--cpu-swap-gib", "0", "--max-model-len", "512"]


def test_offline_closed_loop_keeps_c_in_flight_and_matches_generate(tiny_llama_path: Path) -> None:
    llm = LLM(str(tiny_llama_path), num_device_blocks=256, cpu_swap_gib=0.0, max_model_len=512)
    spec = DatasetSpec("random", num_prompts=7, input_len=24, output_len=5, range_ratio=0.5)
    w = Workload.build(spec, llm.engine.core.vocab_size, llm.engine.model_info.eos_token_ids)
    running: list[int] = []
    step = llm.engine.step

    def counting_step() -> list:  # type: ignore[type-arg]
        running.append(len(llm.engine.core.requests))
        return step()

    llm.engine.step = counting_step  # type: ignore[method-assign]
    try:
        records, duration = offline_closed_loop(llm.engine, w.sessions, 3)
    finally:
        del llm.engine.step
    assert max(running) == 3 and duration > 0
    assert len(records) == 7 and all(r.error is None and r.output_tokens == 5 for r in records)
    assert all(r.ttft_s is not None and r.ttft_s <= r.e2e_s for r in records)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = llm.generate([s.turns[0] for s in w.sessions], params)
    by_session = {r.session: r.output_ids for r in records}
    assert [by_session[i] for i in range(7)] == [list(o.outputs[0].token_ids) for o in expected]


def test_levels_and_rows() -> None:
    assert parse_levels("1,4, 16,64") == [1, 4, 16, 64]
    with pytest.raises(ValueError):
        parse_levels("0,4")
    served = {1: {"requests": 4, "output_throughput": 19.5, "ttft_ms": {"p50": 5.0}, "tpot_ms": {}}}
    offline = {1: {"requests": 4, "output_throughput": 20.0, "ttft_ms": {"p50": 4.0}}}
    (row,) = sweep_rows([1], served, offline)
    assert row["ratio"] == pytest.approx(0.975) and row["ok"] is True
    assert row["served_tpot_p50_ms"] is None  # no request made two tokens
    assert TARGET_RATIO == 0.95
    served[1]["output_throughput"] = 18.0
    assert sweep_rows([1], served, offline)[0]["ok"] is False


def test_sweep_spawned_server_vs_offline(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep.json"
    argv = ["bench", "serve", "--spawn-servers", "cache-on", "--sweep-concurrency", "1,4"]
    argv += ["--compare-offline", "--model", str(tiny_llama_path), *ENGINE_FLAGS]
    argv += ["--dataset", "random", "--num-prompts", "3", "--input-len", "16", "--output-len", "4"]
    argv += ["--warmup-requests", "1", "--no-progress", "--output", str(out)]
    argv += ["--plot", str(tmp_path / "sweep.png")]
    assert cli.main(argv) == 0
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "concurrency" in text and "load avg at start" in text
    report = json.loads(out.read_text())
    rows = report["sweep"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert [r["requests"] for r in rows] == [3, 4]  # at least c requests per level
    for r in rows:
        assert r["served_output_tok_s"] > 0 and r["offline_output_tok_s"] > 0
        assert r["ratio"] == pytest.approx(r["served_output_tok_s"] / r["offline_output_tok_s"])
    for part in ("served", "offline_results"):
        for res in report[part].values():
            assert res["failed"] == 0 and res["output_tokens"] == 4 * res["requests"]
            assert res["cached_prompt_tokens"] == 0  # fresh prompts per level
