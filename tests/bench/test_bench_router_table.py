"""`deja bench router`: the comparison maths, and a tiny end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.router_table import compare, format_comparison
from service import cli


def _result(hit: float, p50: float, p99: float) -> dict[str, object]:
    part = {"prefix_hit_rate": hit, "ttft_ms": {"p50": p50, "p99": p99}}
    return {**part, "turns_2plus": part, "oracle_hit_rate": 0.96}


def test_compare_ratios_are_relative_to_round_robin() -> None:
    rows = compare({"affinity": _result(0.9, 100, 400), "round_robin": _result(0.6, 300, 600)})
    vs = rows["affinity"]["vs_round_robin"]
    assert vs["ttft_p50_ms"] == pytest.approx(3.0)
    assert vs["ttft_p99_ms"] == pytest.approx(1.5)
    assert vs["hit_rate"] == pytest.approx(1.5)
    assert rows["round_robin"]["vs_round_robin"]["ttft_p50_ms"] == pytest.approx(1.0)
    text = format_comparison(rows)
    assert "affinity" in text and "3.00" in text and "96.0%" in text
    # The oracle's 96 % against round robin's 60 %: no policy can reach more than 1.6x.
    assert text.endswith("so none can reach more than 1.60x round robin's here")


def test_bench_router_runs(tiny_llama_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "router", "--model", str(tiny_llama_path), "--num-replicas", "1"]
    argv += ["--policies", "affinity,round_robin", "--num-sessions", "2", "--num-turns", "2"]
    argv += ["--prefix-len", "32", "--input-len", "16", "--output-len", "4", "--no-progress"]
    argv += ["--server-args", "--num-device-blocks 256", "--output", str(out)]
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["comparison"]) == {"affinity", "round_robin"}
    for r in report["results"].values():
        assert r["requests"] == 4 and r["failed"] == 0
    assert report["results"]["affinity"]["routes"]["session"] == 2


def test_pin_cores_wraps_over_the_list() -> None:
    from bench.router import pinned

    assert pinned(["deja", "serve"], "", 0) == ["deja", "serve"]
    assert pinned(["deja"], "0,1", 0) == ["taskset", "-c", "0", "deja"]
    assert pinned(["deja"], "0,1", 3) == ["taskset", "-c", "1", "deja"]


def test_bench_router_overhead_runs(
    tiny_llama_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "router", "--overhead", "--model", str(tiny_llama_path)]
    argv += ["--history-tokens", "512", "--overhead-requests", "5", "--num-replicas", "3"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "router overhead per request: 5 chat requests" in out
    for phase in ("route()", "tokenize", "hash", "lookup", "decide", "record", "cold"):
        line = next(x for x in out.splitlines() if x.startswith(phase))
        p50, p99, top = (float(v) for v in line.split()[1:])
        assert 0 <= p50 <= p99 <= top
        assert phase != "route()" or p50 > 0


def test_bench_router_smg_runs(tiny_llama_path: Path, tmp_path: Path) -> None:
    """The smg policy: SMG's cache_aware router over a replica, OpenAI chat over HTTP."""
    from service.gateway.command import smg_binary

    try:
        smg_binary()
    except FileNotFoundError:
        pytest.skip("smg is not installed")
    out = tmp_path / "bench.json"
    argv = ["bench", "router", "--model", str(tiny_llama_path), "--num-replicas", "1"]
    argv += ["--policies", "smg", "--num-sessions", "2", "--num-turns", "2", "--no-progress"]
    argv += ["--prefix-len", "32", "--input-len", "16", "--output-len", "4"]
    argv += ["--server-args", "--num-device-blocks 256", "--output", str(out)]
    assert cli.main(argv) == 0
    r = json.loads(out.read_text())["results"]["smg"]
    assert r["requests"] == 4 and r["failed"] == 0
    assert r["output_tokens"] >= 4 * 3  # text chunks encoded back to ids
    assert r["turns_2plus"]["prefix_hit_rate"] > 0  # turn 2 repeats turn 1's conversation
