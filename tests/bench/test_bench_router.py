"""`deja bench router` end to end on the tiny random Llama: real replicas and routers (processes),
Poisson arrivals, every policy's report and its ratios to round robin."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import common, router


def test_bench_router_runs_each_policy_on_fresh_replicas(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "router.json"
    flags = ["--model", str(tiny_llama_path), "--policies", "cost,round_robin"]
    flags += ["--num-sessions", "3", "--num-turns", "3", "--prefix-len", "32"]
    flags += ["--input-len", "32", "--output-len", "4", "--max-concurrency", "2"]
    flags += ["--request-rate", "20", "--warmup-requests", "1", "--no-progress"]
    flags += ["--server-args", "--max-num-seqs 4 --threads 1", "--output", str(out_json)]
    flags += ["--simulate", "--sim-profile", "cpu", "--plot", str(tmp_path / "ttft.png")]
    args = common.parse_args(router.add_arguments, flags)
    assert router.run(args) == 0
    assert (tmp_path / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # per policy
    text = capsys.readouterr().out
    assert re.search(r"^cost\s+\d+\.\d%", text, re.M), text
    data = json.loads(out_json.read_text())
    assert data["request_rate"] == 20
    results = data["results"]
    for policy in ("cost", "round_robin"):
        assert results[policy]["requests"] == 9 and results[policy]["failed"] == 0
    # Later turns find their session's history: the cost policy sends them where it is.
    assert results["cost"]["routes"] == {"cost": 10.0}  # 9 requests and the warmup one
    assert results["cost"]["turns_2plus"]["prefix_hit_rate"] > 0.4
    assert data["comparison"]["round_robin"]["ttft_p50_ms_turns_2plus"] is not None
    # The oracle (one replica, unlimited cache) bounds every policy's hit rate from above.
    for policy in ("cost", "round_robin"):
        row = data["comparison"][policy]
        assert 0 < row["hit_rate"] <= row["oracle_hit_rate"] < 1.0
    assert re.search(r"^load avg at end [\d.]+, .*\(at start [\d.]+, ", text, re.M), text
    assert len(data["machine"]["load_avg_at_start"]) == 3
    assert re.search(r"^machine: .+, \d+ cores, cpu flags: ", text, re.M), text
    assert re.search(r"^oracle: .* more than \d+\.\d\dx round robin's here$", text, re.M), text
    # --simulate: the same 9 requests per policy replayed in the simulator, beside the measured.
    for policy in ("cost", "round_robin"):
        sim = data["simulated"][policy]
        assert sim["measured"]["requests"] == sim["simulated"]["requests"] == 9
        assert sim["simulated"]["p50_s"] > 0
        assert re.search(rf"^{policy}\s+sim\s+\d+\.\d", text, re.M), text
        assert re.search(rf"^{policy}: simulated TTFT p50 within 25% of the measured: ", text, re.M)
    # ... with the step costs scaled to the replicas' measured busy time (deja_engine_busy_seconds)
    scale = data["simulated_busy_scale"]
    assert scale["measured_busy_s"] > 0 and scale["engine_only_busy_s"] > 0
    assert scale["simulated_busy_s"] == pytest.approx(scale["measured_busy_s"], rel=0.05)
    assert set(scale["engine_only_p50_s"]) == {"cost", "round_robin"}
    assert re.search(r"^step costs x \d+\.\d\d: the replicas' engines were busy", text, re.M)


def test_bench_router_refuses_a_sim_profile_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.json"
    flags = ["--simulate", "--sim-profile", str(missing), "--no-progress"]
    assert router.run(common.parse_args(router.add_arguments, flags)) == 2  # before any process
    assert f"--sim-profile {missing}: " in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    flags[2] = str(bad)
    assert router.run(common.parse_args(router.add_arguments, flags)) == 2
    assert "'fit'" in capsys.readouterr().err


def test_bench_router_refuses_a_rate_that_is_not_positive(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = common.parse_args(router.add_arguments, ["--request-rate", "0", "--no-progress"])
    assert router.run(args) == 2  # before any process starts
    assert "--request-rate must be > 0" in capsys.readouterr().err


def test_bench_router_sets_the_rate_from_round_robins_measured_capacity(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "router.json"
    flags = ["--model", str(tiny_llama_path), "--policies", "cost", "--capacity-share", "0.5"]
    flags += ["--num-sessions", "2", "--num-turns", "2", "--prefix-len", "32"]
    flags += ["--input-len", "32", "--output-len", "4", "--max-concurrency", "2"]
    flags += ["--warmup-requests", "1", "--no-progress", "--output", str(out_json)]
    flags += ["--server-args", "--max-num-seqs 4 --threads 1"]
    args = common.parse_args(router.add_arguments, flags)
    assert router.run(args) == 0
    err = capsys.readouterr().err
    data = json.loads(out_json.read_text())
    capacity = data["machine"]["capacity_rps"]
    assert capacity > 0
    assert data["request_rate"] == pytest.approx(0.5 * capacity)
    assert re.search(r"closed-loop capacity: [\d.]+ requests/s \(4 in ", err), err
    assert data["results"]["cost"]["requests"] == 4 and data["results"]["cost"]["failed"] == 0
    bad = common.parse_args(router.add_arguments, ["--capacity-share", "1.5", "--no-progress"])
    assert router.run(bad) == 2
