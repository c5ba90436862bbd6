"""`deja bench latency --quick` end to end on the tiny random Llama: a real `deja serve`
subprocess, the offline engine and transformers, one after another; with --gateway, the real
`smg` binary (`deja gateway`) in front of a real replica against that replica's deja.v1."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import common, latency
from bench.latency import Sample, SystemResult, checks


def test_latency_quick(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "latency.json"
    argv = ["--model", str(tiny_llama_path), "--quick", "--num-device-blocks", "64"]
    assert (
        latency.run(common.parse_args(latency.add_arguments, [*argv, "--json", str(out_json)])) == 0
    )
    text = capsys.readouterr().out
    for name in ("served (gRPC)", "offline (LLMEngine)", "transformers generate"):
        assert re.search(rf"^{re.escape(name)}\s+\d+\.\d\d\s+\d+\.\d\d\s", text, re.M), text
    assert "greedy tokens served == offline: 2/2 requests" in text
    assert re.search(
        r"^served / offline decode: \d+\.\d\d \(target >= 0.95\) (PASS|FAIL)$", text, re.M
    )
    assert re.search(r"^served TTFT - offline TTFT \(ms\): -?\d+\.\d\d .* (PASS|FAIL)$", text, re.M)
    assert re.search(r"^load avg at end [\d.]+, [\d.]+, [\d.]+.*\(at start ", text, re.M), text
    data = json.loads(out_json.read_text())
    for r in data["results"].values():
        assert r["output_tokens"] == [8, 8]  # EOS ignored everywhere
        assert r["decode_tok_s_p50"] > 0 and r["ttft_ms_p50"] > 0
    assert data["results"]["served (gRPC)"]["cached_tokens"] == [0, 0]
    assert set(data["checks"]) == {
        "served / offline decode",
        "served / transformers decode",
        "served TTFT - offline TTFT (ms)",
    }


def test_checks_against_the_targets() -> None:
    def system(ttft_s: float, decode_s: float) -> SystemResult:
        # 11 tokens: 10 decode intervals over decode_s seconds.
        return SystemResult("x", [Sample(ttft_s, decode_s, list(range(11)))])

    offline, hf = system(0.100, 1.0), system(0.100, 1.25)  # 10 and 8 tok/s
    fast = {c.name: c for c in checks(system(0.105, 1.0 / 0.96), offline, hf)}
    assert fast["served / offline decode"].ok and fast[
        "served / offline decode"
    ].value == pytest.approx(0.96)
    assert fast["served / transformers decode"].ok
    assert fast["served TTFT - offline TTFT (ms)"].ok
    slow = {c.name: c for c in checks(system(0.120, 2.0), offline, hf)}
    assert not any(c.ok for c in slow.values())
    assert slow["served TTFT - offline TTFT (ms)"].value == pytest.approx(20.0)


def test_latency_gateway_quick(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "gateway.json"
    argv = ["--model", str(tiny_llama_path), "--quick", "--num-device-blocks", "256", "--gateway"]
    args = common.parse_args(latency.add_arguments, [*argv, "--json", str(out_json)])
    assert latency.run(args) == 0
    text = capsys.readouterr().out
    for name in ("deja.v1 (gRPC)", "SMG (OpenAI HTTP)"):
        assert re.search(rf"^{re.escape(name)}\s+\d+\.\d\d\s+\d+\.\d\d\s", text, re.M), text
    for level in (8, 32):
        assert re.search(rf"^{level}\s+\d+\.\d\d\s+\d+\.\d\d\s+\d+\.\d\d", text, re.M), text
    bounds = [
        r"SMG / deja.v1 decode tok/s: \d+\.\d\d \(bound >= 0.95\)",
        r"SMG TTFT - deja.v1 TTFT \(ms\): -?\d+\.\d\d \(bound <= 10.0\)",
        r"SMG / deja.v1 output tok/s at concurrency 8: \d+\.\d\d \(bound >= 0.95\)",
        r"SMG / deja.v1 output tok/s at concurrency 32: \d+\.\d\d \(bound >= 0.95\)",
    ]
    for line in bounds:
        assert re.search(rf"^{line} (MET|NOT MET)$", text, re.M), text
    data = json.loads(out_json.read_text())
    for path in data["one_user"].values():
        assert path["output_tokens"] == [8, 8]  # EOS ignored on both paths
        assert min(path["ttft_ms"]) > 0
        # A rate wherever the tokens came in more than one message; none (not 0) where one
        # message brought them all
        for rate, messages in zip(path["decode_tok_s"], path["token_messages"], strict=True):
            assert (rate is not None and rate > 0) if messages > 1 else rate is None, messages
    for level, runs in data["load"].items():
        for path_runs in runs.values():
            (run,) = path_runs  # one round with --quick
            assert run["failed"] == 0 and run["requests"] == int(level)
            assert run["output_tokens"] == 8 * int(level) and run["output_throughput"] > 0
