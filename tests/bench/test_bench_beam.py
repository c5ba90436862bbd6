"""deja bench beam end to end in --quick mode on the tiny random Llama."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import beam, common


def test_beam_quick(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "result.json"
    args = common.parse_args(
        beam.add_arguments, ["--model", str(tiny_llama_path), "--quick", "--json", str(out_json)]
    )
    assert beam.run(args) == 0
    text = capsys.readouterr().out
    m = re.search(r"^ratio KV blocks beam 4 / greedy \(peak\): (\d+\.\d+)x$", text, re.M)
    assert m, text
    data = json.loads(out_json.read_text())
    # 128-token prompt (8 full blocks) + 8 tokens: greedy holds 9 blocks; four beams share the
    # prompt's 8 and hold at most one block of output each.
    assert data["greedy"]["peak_blocks"] == 9
    assert 9 < data["beam"]["peak_blocks"] <= 12
    assert data["meets_target"] is (data["ratios"]["peak_blocks_beam_over_greedy"] <= beam.TARGET)
