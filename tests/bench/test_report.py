"""bench/report.py: the machine line's CPU steal over a run."""

from __future__ import annotations

import pytest

from bench import report


def test_steal_share_counts_the_hypervisors_share_of_the_interval() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    start = [100, 0, 50, 800, 10, 0, 5, 35, 20, 0]
    end = [160, 0, 70, 900, 10, 0, 5, 55, 30, 0]  # +80 user/system, +100 idle, +20 steal
    assert report.steal_share(start, end) == 20 / 200  # guest time is inside user: not added
    assert report.steal_share([], end) is None
    assert report.steal_share(start[:7], end[:7]) is None  # a kernel without a steal counter
    assert report.steal_share(start, start) is None  # no time passed


def test_finish_line_prints_the_steal_and_flags_a_noisy_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    info = report.machine_info(threads=1)
    line = report.finish_line(info)
    assert line.startswith("load avg at end ")
    assert "cpu_steal_share" in info  # None when unknown, or when no CPU time passed
    stolen = {**info, "cpu_times_at_start": [0] * 8}
    monkeypatch.setattr(report, "cpu_times", lambda: [10] * 7 + [90])  # 90 of 160 stolen
    assert "CPU steal 56.2% during the run (the hypervisor gave" in report.finish_line(stolen)
