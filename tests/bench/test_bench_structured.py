"""`deja bench structured` runs end to end in --quick mode on the tiny random Llama."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import common, structured


def test_structured_quick(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "structured.json"
    argv = ["--model", str(tiny_llama_path), "--quick", "--reps", "2", "--json", str(out_json)]
    assert structured.run(common.parse_args(structured.add_arguments, argv)) == 0
    text = capsys.readouterr().out
    # One line per pair, the order alternating, then a verdict on the median. Only the format is
    # checked: the ratios are timings, any size under load.
    num = r"(\d+\.\d{3})"
    pair_1 = re.search(rf"^  pair 1 \(json_schema first\) .* ratio {num} ", text, re.M)
    pair_2 = re.search(rf"^  pair 2 \(free first +\) .* ratio {num} ", text, re.M)
    assert pair_1 and pair_2, text
    verdict = re.search(
        rf"^(PASS|FAIL): throughput json_schema / free = {num}x, median of 2 pairs "
        rf"\[{num} {num}\] \(target >= 0\.9x\)$",
        text,
        re.M,
    )
    assert verdict, text
    data = json.loads(out_json.read_text())
    assert [p["order"] for p in data["pairs"]] == ["json_schema first", "free first"]
    ratios = sorted(p["ratio"] for p in data["pairs"])
    assert data["ratio"] == pytest.approx((ratios[0] + ratios[1]) / 2)
    assert data["verdict"] == ("PASS" if data["ratio"] >= 0.9 else "FAIL") == verdict.group(1)
    # The text shows the JSON's numbers.
    assert [pair_1.group(1), pair_2.group(1)] == [f"{p['ratio']:.3f}" for p in data["pairs"]]
    assert verdict.group(2) == f"{data['ratio']:.3f}"
    assert [verdict.group(3), verdict.group(4)] == [f"{r:.3f}" for r in ratios]
    # The free run is length-matched: the same tokens as the schema run, pair by pair.
    for p in data["pairs"]:
        assert p["free"]["tokens"] == p["json_schema"]["tokens"] > 0
