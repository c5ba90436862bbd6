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
    # One line per pair, the order alternating, then a verdict on the median.
    assert re.search(r"^  pair 1 \(json_schema first\) .* ratio \d\.\d{3} ", text, re.M), text
    assert re.search(r"^  pair 2 \(free first +\) .* ratio \d\.\d{3} ", text, re.M), text
    verdict = re.search(
        r"^(PASS|FAIL): throughput json_schema / free = (\d+\.\d{3})x, median of 2 pairs "
        r"\[\d\.\d{3} \d\.\d{3}\] \(target >= 0\.9x\)$",
        text,
        re.M,
    )
    assert verdict, text
    data = json.loads(out_json.read_text())
    assert [p["order"] for p in data["pairs"]] == ["json_schema first", "free first"]
    ratios = sorted(p["ratio"] for p in data["pairs"])
    assert data["ratio"] == pytest.approx((ratios[0] + ratios[1]) / 2)
    assert data["verdict"] == ("PASS" if data["ratio"] >= 0.9 else "FAIL") == verdict.group(1)
    # The free run is length-matched: the same tokens as the schema run, pair by pair.
    for p in data["pairs"]:
        assert p["free"]["tokens"] == p["json_schema"]["tokens"] > 0
