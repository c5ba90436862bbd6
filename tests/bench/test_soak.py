"""`deja bench soak`: the verdict rules on made-up samples, the load's outcome accounting, and a
few seconds of the real command against a spawned `deja serve` on the tiny model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import common, soak
from bench.soak_report import MIB, EndState, Sample, baseline, judge

CLEAN_END = EndState(device_free=64, device_total=64, cpu_held_by_swaps=0)


def _s(t: float, rss_mib: float, *, fds: int = 40, threads: int = 20, failed: int = 0) -> Sample:
    return Sample(
        t, 100 * int(t), failed, int(rss_mib * MIB), fds, threads, 64, 64, 1, 8, 2, 16, 1000
    )


def _checks(samples: list[Sample], end: EndState | None = CLEAN_END) -> dict[str, bool]:
    return {c.name: c.ok for c in judge(samples, end, warmup_s=300).checks}


def test_clean_run_passes() -> None:
    samples = [_s(0, 400), _s(150, 450), _s(300, 500), _s(900, 510), _s(1800, 520)]
    verdict = judge(samples, CLEAN_END, warmup_s=300)
    assert verdict.ok, verdict.format()
    assert "500.0 MiB at 300 s -> 520.0 MiB at 1800 s (+4.0%" in verdict.format()


def test_growth_during_warmup_is_not_counted_but_after_it_is() -> None:
    # +25% before the baseline is fine; +6% after it is not.
    assert _checks([_s(0, 400), _s(300, 500), _s(1800, 530)])["rss"] is False
    assert _checks([_s(0, 400), _s(300, 500), _s(1800, 524)])["rss"] is True


def test_baseline_is_first_sample_after_warmup_or_last() -> None:
    samples = [_s(0, 1), _s(200, 2), _s(310, 3), _s(600, 4)]
    assert baseline(samples, 300) == samples[2]
    assert baseline(samples, 9999) == samples[-1]
    assert baseline([], 1) is None


def test_fd_and_thread_growth_beyond_slack_fails() -> None:
    base = _s(300, 500)
    assert _checks([base, _s(1800, 500, fds=48)])["fds"] is True
    assert _checks([base, _s(1800, 500, fds=49)])["fds"] is False
    assert _checks([base, _s(1800, 500, threads=25)])["threads"] is False
    assert _checks([base, _s(1800, 500, fds=30, threads=10)]) == dict.fromkeys(
        ("rss", "fds", "threads", "blocks", "failures"), True
    )


def test_blocks_in_use_at_the_end_fail() -> None:
    samples = [_s(300, 500), _s(1800, 500)]
    assert _checks(samples, EndState(63, 64, 0))["blocks"] is False
    assert _checks(samples, EndState(64, 64, 2))["blocks"] is False
    assert _checks(samples, None)["blocks"] is False


def test_failed_requests_fail_and_unmeasured_figures_never_pass() -> None:
    assert _checks([_s(300, 500), _s(1800, 500, failed=1)])["failures"] is False
    blind = Sample(1800, 10, 0, None, None, None, 64, 64, None, None, None, None, None)
    verdict = judge([blind], CLEAN_END, warmup_s=300)
    assert not verdict.ok
    assert {c.name for c in verdict.checks if not c.ok} == {"rss", "fds", "threads"}
    assert not judge([], CLEAN_END, warmup_s=300).ok


def test_only_deliberate_cancels_and_deadlines_are_not_failures() -> None:
    tally = soak.Tally()
    tally.add("cancel", "CANCELLED")
    tally.add("deadline", "DEADLINE_EXCEEDED")
    tally.add("deadline", "OK")
    assert (tally.requests, tally.failed) == (3, 0)
    tally.add("random", "DEADLINE_EXCEEDED", "took too long")
    tally.add("cancel", "INTERNAL", "boom")
    tally.add("n", "RESOURCE_EXHAUSTED")
    assert (tally.requests, tally.failed) == (6, 3)
    assert tally.errors[0] == "random: DEADLINE_EXCEEDED: took too long"


def test_parse_mix() -> None:
    assert soak.parse_mix("random=2,cancel") == {"random": 2.0, "cancel": 1.0}
    with pytest.raises(ValueError, match="unknown kind 'bogus'"):
        soak.parse_mix("bogus=1")
    with pytest.raises(ValueError, match="positive weight"):
        soak.parse_mix("random=0")


def test_load_requests_fit_the_model_and_cover_every_kind() -> None:
    args = common.parse_args(
        soak.add_arguments,
        ["--input-len", "64", "--prefix-len", "200", "--output-len", "8", "--seed", "3"],
    )
    load = soak.SoakLoad(args, vocab_size=512, reserved=[0, 2], max_model_len=256)
    seen = set()
    for _ in range(400):
        job = load.next()
        seen.add(job.kind)
        ids = list(job.request.token_ids.ids)
        assert len(ids) > 0 and len(ids) + job.request.sampling.max_tokens <= 256
        assert not {0, 2} & set(ids)
        assert (job.kind == "cancel") == (job.cancel_after_s is not None)
        assert (job.kind == "deadline") == (job.timeout_s is not None)
        load.done(job, [7, 8] if job.kind == "multi_turn" else None)
    assert seen == set(soak.KINDS)
    assert not load.busy
    assert any(s[-2:] == [7, 8] for s in load.sessions)


def test_soak_command_against_a_spawned_replica(
    tiny_llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    serve = (
        f"--model {tiny_llama_path} --num-device-blocks 64 --cpu-swap-gib 0.0005 "
        f"--disk-dir {tmp_path / 'disk'} --disk-gib 0.002 --max-model-len 512 --log-level warning"
    )
    flags = "--duration 4 --warmup 1 --sample-interval 1 --concurrency 8 --input-len 32"
    flags += " --prefix-len 48 --output-len 6 --max-pin-s 1"
    args = common.parse_args(soak.add_arguments, [*flags.split(), "--serve-args", serve])
    code = soak.run(args)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: PASS" in out
    assert re.search(r"ok  blocks +device 64/64 free, 0 CPU blocks", out), out
    rows = [line.split() for line in out.splitlines() if re.match(r"^ +\d+ +\d+ +\d+ +\d", line)]
    assert rows and all(r[3] != "-" and r[-1] != "-" for r in rows)  # RSS and object counts
    assert int(rows[-1][1]) > 0
