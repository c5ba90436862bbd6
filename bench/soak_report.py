"""What `deja bench soak` samples, and how it judges a run: the table and the verdict.

Pure functions over `Sample`s (no I/O), so the verdict rules are unit-tested on their own:

    rss          RSS (server + its child processes) at the end of the run is less than
                 `rss_limit` (5 %) above RSS at the first sample at or after the warm-up
    fds          open file descriptors at the end <= at warm-up + `fd_slack`
    threads      threads at the end <= at warm-up + `thread_slack`
    blocks       after the load stopped (and pins expired): every device block free and no
                 CPU-tier block held by a swapped-out sequence
    failures     no request failed other than the deliberate cancels and deadlines

A check whose figure was not reachable (no server pid, no stats) is reported as "n/a" and does
not pass: a verdict of PASS means every check was measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 2**20


@dataclass(frozen=True, slots=True)
class Sample:
    """One row of the table."""

    t_s: float
    """Seconds since the load started."""
    requests: int
    """Requests finished (any outcome) so far."""
    failed: int
    """Requests that failed other than the deliberate cancels / deadlines."""
    rss_bytes: int | None
    """Resident memory of the server process plus its children (None: no pid to look at)."""
    fds: int | None
    threads: int | None
    device_free: int | None
    device_total: int | None
    cpu_used: int | None
    """CPU tier: cached blocks + swapped-out tails."""
    cpu_total: int | None
    disk_used: int | None
    disk_total: int | None
    py_objects: int | None
    """gc-tracked objects in the serving process (from its /metrics), None when unreachable."""
    children_rss_bytes: int | None = None
    """Resident memory of the child processes alone (the engine core), part of `rss_bytes`."""
    buffer_bytes: int | None = None
    """Host bytes in the disk tier's read cache and write queue (GetCacheStats buffers)."""


@dataclass(frozen=True, slots=True)
class EndState:
    """The cache after the load stopped and the pins expired."""

    device_free: int
    device_total: int
    cpu_held_by_swaps: int
    """CPU-tier blocks held by swapped-out sequences (used - cached)."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class Verdict:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def format(self) -> str:
        lines = [f"  {'ok ' if c.ok else 'BAD'} {c.name:<9} {c.detail}" for c in self.checks]
        return "\n".join([f"verdict: {'PASS' if self.ok else 'FAIL'}", *lines])


def baseline(samples: list[Sample], warmup_s: float) -> Sample | None:
    """The first sample at or after the warm-up (the last one when the run was shorter)."""
    for s in samples:
        if s.t_s >= warmup_s:
            return s
    return samples[-1] if samples else None


def _flat(name: str, base: int | None, last: int | None, slack: int) -> Check:
    if base is None or last is None:
        return Check(name, False, "n/a (not measured)")
    return Check(name, last <= base + slack, f"{base} -> {last} (allowed +{slack})")


def judge(
    samples: list[Sample],
    end: EndState | None,
    *,
    warmup_s: float,
    rss_limit: float = 0.05,
    fd_slack: int = 8,
    thread_slack: int = 4,
) -> Verdict:
    """The verdict of a run (see the module docstring for the rules)."""
    if not samples:
        return Verdict([Check("samples", False, "no samples were taken")])
    base = baseline(samples, warmup_s)
    assert base is not None
    last = samples[-1]
    checks: list[Check] = []
    if base.rss_bytes is None or last.rss_bytes is None:
        checks.append(Check("rss", False, "n/a (no server process to measure)"))
    else:
        growth = last.rss_bytes / base.rss_bytes - 1.0
        peak = max(s.rss_bytes or 0 for s in samples if s.t_s >= base.t_s)
        checks.append(
            Check(
                "rss",
                growth < rss_limit,
                f"{base.rss_bytes / MIB:.1f} MiB at {base.t_s:.0f} s -> "
                f"{last.rss_bytes / MIB:.1f} MiB at {last.t_s:.0f} s ({growth:+.1%}, "
                f"limit +{rss_limit:.0%}; peak {peak / MIB:.1f} MiB)",
            )
        )
    checks.append(_flat("fds", base.fds, last.fds, fd_slack))
    checks.append(_flat("threads", base.threads, last.threads, thread_slack))
    if end is None:
        checks.append(Check("blocks", False, "n/a (no cache stats at the end)"))
    else:
        ok = end.device_free == end.device_total and end.cpu_held_by_swaps == 0
        checks.append(
            Check(
                "blocks",
                ok,
                f"device {end.device_free}/{end.device_total} free, "
                f"{end.cpu_held_by_swaps} CPU blocks held by swapped-out sequences",
            )
        )
    checks.append(
        Check("failures", last.failed == 0, f"{last.failed} of {last.requests} requests failed")
    )
    return Verdict(checks)


def _opt(value: int | None, scale: float = 1.0, fmt: str = "d") -> str:
    if value is None:
        return "-"
    return format(value / scale if scale != 1.0 else value, fmt)


def _pair(used: int | None, total: int | None) -> str:
    return "-" if used is None or total is None else f"{used}/{total}"


HEADER = (
    f"{'t_s':>6} {'reqs':>7} {'fail':>5} {'rss_mib':>8} {'fds':>5} {'thr':>4} "
    f"{'dev_free':>9} {'cpu_used':>9} {'disk_used':>10} {'py_objs':>9} {'core_mib':>8} "
    f"{'dbuf_mib':>8}"
)


def format_row(s: Sample) -> str:
    return (
        f"{s.t_s:>6.0f} {s.requests:>7} {s.failed:>5} {_opt(s.rss_bytes, MIB, '.1f'):>8} "
        f"{_opt(s.fds):>5} {_opt(s.threads):>4} {_pair(s.device_free, s.device_total):>9} "
        f"{_pair(s.cpu_used, s.cpu_total):>9} {_pair(s.disk_used, s.disk_total):>10} "
        f"{_opt(s.py_objects):>9} {_opt(s.children_rss_bytes, MIB, '.1f'):>8} "
        f"{_opt(s.buffer_bytes, MIB, '.1f'):>8}"
    )


def format_table(samples: list[Sample]) -> str:
    return "\n".join([HEADER, *(format_row(s) for s in samples)])
