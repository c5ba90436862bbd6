"""`deja bench serve`: datasets, statistics, and whole runs against real servers."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from bench.loadgen import compare
from bench.workload import (
    DatasetSpec,
    Record,
    Session,
    Workload,
    build_sessions,
    oracle_cached_tokens,
    percentiles,
    run_workload,
    summarize_by_turn,
)
from service import cli
from tests.service.conftest import Harness


def test_datasets() -> None:
    rnd = build_sessions(
        DatasetSpec("random", num_prompts=10, input_len=20, range_ratio=0.5), 512, [2]
    )
    assert len(rnd) == 10 and all(len(s.turns) == 1 and not s.prefix for s in rnd)
    assert all(10 <= len(s.turns[0]) <= 30 for s in rnd)
    assert all(64 <= t < 512 and t != 2 for s in rnd for t in s.turns[0])

    sp = build_sessions(
        DatasetSpec("shared-prefix", num_prompts=8, num_groups=2, prefix_len=32), 512, []
    )
    assert {tuple(s.prefix) for s in sp} == {tuple(sp[0].prefix), tuple(sp[1].prefix)}

    mt = build_sessions(
        DatasetSpec("multi-turn", num_sessions=3, num_turns=4, prefix_len=16), 512, []
    )
    assert len(mt) == 3 and all(len(s.turns) == 4 and s.prefix == mt[0].prefix for s in mt)
    again = build_sessions(
        DatasetSpec("multi-turn", num_sessions=3, num_turns=4, prefix_len=16), 512, []
    )
    assert again == mt  # seeded


def test_oracle_cached_tokens() -> None:
    """Block size 4: the shared prefix is 2 blocks; a turn reuses the blocks its previous turn
    computed (not the block holding the last output token, whose KV is never written); a prompt
    that is all cached still computes its last token; failed turns count for nothing."""
    prefix, user = list(range(1, 9)), [20, 21, 22, 23, 24]
    sessions = [
        Session(prefix, [user, [30, 31, 32, 33, 34]], 3),
        Session(prefix, [[40, 41, 42, 43, 44], [50] * 5], 3),
        Session(prefix, [user[:4]], 3),
    ]
    records = [
        Record(2, 1, prompt_tokens=12, output_ids=[9, 9, 9]),
        Record(0, 2, prompt_tokens=21, output_ids=[5, 6, 7]),
        Record(0, 1, prompt_tokens=13, output_ids=[100, 101, 102]),
        Record(1, 1, prompt_tokens=13, output_ids=[7, 7, 7]),
        Record(1, 2, prompt_tokens=21, error="UNAVAILABLE"),
    ]
    # s0 t1: 0; s1 t1: the prefix, 8; s2 t1 (12 tokens): 8, its third block is cached but holds
    # its last token; s0 t2: 3 blocks of t1's 15 computed tokens, 12; s1 t2 failed.
    assert oracle_cached_tokens(sessions, records, 4) == 28
    assert oracle_cached_tokens(sessions, records[:1], 4) == 0
    with pytest.raises(ValueError, match="not this workload's record"):
        oracle_cached_tokens(sessions, [Record(0, 1, prompt_tokens=14)], 4)


def test_statistics() -> None:
    assert percentiles([1.0, 2.0, 3.0, 4.0]) == pytest.approx(
        {"mean": 2500.0, "p50": 2500.0, "p90": 3700.0, "p99": 3970.0}
    )
    recs = [
        Record(
            0, 1, prompt_tokens=100, output_ids=[1, 2, 3], cached_tokens=0, ttft_s=0.5, e2e_s=0.7
        ),
        Record(
            0, 2, prompt_tokens=200, output_ids=[1, 2, 3], cached_tokens=160, ttft_s=0.1, e2e_s=0.3
        ),
        Record(1, 1, prompt_tokens=100, error="UNAVAILABLE"),
    ]
    s = summarize_by_turn(recs, 2.0)
    assert s["requests"] == 3 and s["failed"] == 1
    assert s["prefix_hit_rate"] == pytest.approx(160 / 300)
    assert s["turns_2plus"]["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["turn_1"]["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    c = compare({"cache-on": s, "cache-off": summarize_by_turn([recs[0], recs[0]], 2.0)})
    assert c["ttft_p50_ms"]["speedup_cache_on"] == pytest.approx(5.0)


async def test_bench_serve_multi_turn_against_a_server(server: Harness, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--target", server.target, "--dataset", "multi-turn"]
    argv += ["--num-sessions", "3", "--num-turns", "3", "--prefix-len", "64", "--input-len", "8"]
    argv += ["--output-len", "4", "--max-concurrency", "2", "--no-progress", "--json"]
    argv += ["--output", str(out)]
    assert await asyncio.to_thread(cli.main, argv) == 0
    report = json.loads(out.read_text())
    r = report["results"]["target"]
    assert r["requests"] == 9 and r["failed"] == 0
    assert r["output_tokens"] == 36
    assert r["turns_2plus"]["requests"] == 6
    # Later turns extend earlier prompts, so most of their tokens come from the cache.
    assert r["turns_2plus"]["prefix_hit_rate"] > 0.5
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(r[key]) == {"mean", "p50", "p90", "p99"}
    await server.assert_clean()


async def test_bench_serve_poisson_rate(server: Harness, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--target", server.target, "--dataset", "shared-prefix"]
    argv += ["--num-prompts", "8", "--prefix-len", "32", "--input-len", "8", "--output-len", "2"]
    argv += [
        "--request-rate",
        "40",
        "--max-concurrency",
        "0",
        "--no-progress",
        "--output",
        str(out),
    ]
    assert await asyncio.to_thread(cli.main, argv) == 0
    report = json.loads(out.read_text())
    assert report["request_rate"] == 40 and report["results"]["target"]["failed"] == 0


async def test_request_rate_must_be_positive() -> None:
    for rate in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="request rate must be > 0"):
            await run_workload(None, [], max_concurrency=None, request_rate=rate)  # type: ignore[arg-type]


@pytest.mark.slow
def test_spawn_servers_cache_on_off_and_in_process(tiny_llama_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--spawn-servers", "cache-on,cache-off", "--compare-in-process"]
    argv += ["--model", str(tiny_llama_path), "--num-device-blocks", "256", "--cpu-swap-gib", "0"]
    argv += ["--max-model-len", "1024", "--dataset", "multi-turn", "--num-sessions", "2"]
    argv += ["--num-turns", "2", "--prefix-len", "64", "--input-len", "8", "--output-len", "4"]
    argv += ["--no-progress", "--output", str(out), "--plot", str(tmp_path / "ttft.png")]
    assert cli.main(argv) == 0
    assert (tmp_path / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # TTFT by turn
    report = json.loads(out.read_text())
    on, off = report["results"]["cache-on"], report["results"]["cache-off"]
    assert set(on["ttft_ms_by_turn"]) == {"1", "2"}
    assert on["turns_2plus"]["prefix_hit_rate"] > 0.5
    assert off["prefix_hit_rate"] == 0.0
    assert on["replica_id"] == "cache-on" and off["replica_id"] == "cache-off"
    c = report["comparison"]
    assert c["ttft_p50_ms"]["scope"] == "turns_2plus"
    assert math.isfinite(c["grpc_overhead"]["ratio"])
    assert report["results"]["in-process"]["failed"] == 0


def test_workload_warmup_is_disjoint() -> None:
    w = Workload.build(DatasetSpec("multi-turn", num_sessions=2, prefix_len=32), 512, [])
    warm = w.warmup(2, seed=0)
    assert len(warm) == 2 and all(s.turns[0][:8] != w.sessions[0].prefix[:8] for s in warm)
