"""`deja bench window`: the acceptance figure, measured through the engine and printed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import common, window


def test_window_bench_2048_tokens_window_256(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 2,048-token sequence with window 256 and blocks of 16 holds 17 blocks while decoding
    (window / block_size + 1 for its one layer group); full attention holds all 130."""
    out_json = tmp_path / "window.json"
    args = common.parse_args(
        window.add_arguments, ["--cache-dir", str(tmp_path), "--json", str(out_json)]
    )
    assert window.run(args) == 0
    text = capsys.readouterr().out
    print(text)
    assert re.search(
        r"^blocks in use for a 2048-token sequence with window 256: 17 \(bound .* = 17 .*\): ok$",
        text,
        re.M,
    ), text
    data = json.loads(out_json.read_text())
    assert data["window"]["peak_blocks_decode"] == 17
    assert data["window"]["peak_blocks_prefill"] == 32  # the window's 16 + one 256-token chunk
    assert data["full"]["peak_blocks_decode"] == 130
    assert data["window"]["kv_window"] == 256 and data["full"]["kv_window"] is None
    assert data["window"]["output_tokens"] == data["full"]["output_tokens"] == 32
