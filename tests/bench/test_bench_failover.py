"""`deja bench failover` on real processes: two `deja serve` replicas and a real redis-server;
turns 1-4 on A, A SIGKILLed, turn 5 on B comes from the remote tier, token-exact with the same
turn recomputed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import common, failover


def test_a_session_moved_by_a_crash_keeps_its_history(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "result.json"
    args = common.parse_args(
        failover.add_arguments,
        ["--model", str(tiny_llama_path), "--quick", "--json", str(out_json), "--threads", "1"],
    )
    assert failover.run(args) == 0
    text = capsys.readouterr().out
    r = json.loads(out_json.read_text())["failover"]
    assert r["identical_answer"], text
    # turn 5: 320 + 5 x 16 + 4 x 8 = 432 prompt tokens; A computed the KV of all but the last
    # answer token of turn 4: 25 full blocks (400 tokens), written behind before it was killed
    assert r["prompt_tokens"] == 432
    assert r["remote_tokens"] == 400
    assert r["remote_share"] >= 0.9, text
    assert r["recomputed_cached_tokens"] == 0
    assert "after A's SIGKILL" in text
