"""The disk-tier benchmarks run end to end in quick mode on the tiny random Llama."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import common, offline, tiers


def test_offline_compare_disk_write_through_quick(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "offline.json"
    argv = ["--model", str(tiny_llama_path), "--quick", "--json", str(out_json)]
    argv += ["--compare-disk-write-through", "--skip-generate", "--skip-generate-batch"]
    assert offline.run(common.parse_args(offline.add_arguments, [*argv, "--parity", "0"])) == 0
    text = capsys.readouterr().out
    assert re.search(
        r"^ratio ours with / without the disk tier \(write-through\): \d+\.\d+x", text, re.M
    ), text
    assert "identical outputs 8/8" in text
    data = json.loads(out_json.read_text())
    cmp = data["disk_write_through"]
    assert cmp["reps"] == 1 and cmp["ratio_with_over_without"] > 0
    (with_disk,) = (k for k in data["results"] if "disk write-through" in k)
    assert re.search(r"\((\d+) blocks queued, 0 dropped\)", with_disk), with_disk
    assert "transformers" not in " ".join(data["results"])


def test_tiers_restart_quick(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "tiers.json"
    argv = ["--model", str(tiny_llama_path), "--quick", "--part", "restart"]
    argv += ["--restart-prefixes", "64", "--json", str(out_json)]
    assert tiers.run(common.parse_args(tiers.add_arguments, argv)) == 0
    text = capsys.readouterr().out
    assert re.search(r"^restart, 64-token prefix \(median of 1\): recompute", text, re.M), text
    assert re.search(r"disk load speed: .* of the same 4 files: \d+%", text), text
    row = json.loads(out_json.read_text())["restart"]["64"]
    assert row["disk_hit_tokens"] == 64 and row["cpu_hit_tokens"] == 64
    assert row["load_speed"]["ratio"] > 0


def test_tiers_ttft_quick_serves_each_tier(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Part 1: each row's prompt is served from the tier it names, the remote one by another
    engine sharing a real redis-server."""
    out_json = tmp_path / "tiers.json"
    argv = ["--model", str(tiny_llama_path), "--quick", "--part", "ttft", "--json", str(out_json)]
    assert tiers.run(common.parse_args(tiers.add_arguments, argv)) == 0
    rows = json.loads(out_json.read_text())["ttft"]["tiers"]
    assert set(rows) == {"device", "cpu", "disk", "remote", "recompute"}
    for tier in ("device", "cpu", "disk", "remote"):
        assert rows[tier]["cached_tokens_min"][tier] == 128, (tier, rows[tier])
