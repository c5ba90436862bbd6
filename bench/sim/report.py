"""Figures of one simulated run: TTFT percentiles, hit rate against the oracle, load balance."""

from __future__ import annotations

from dataclasses import dataclass

from bench.sim.cluster import SimResult


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True, slots=True)
class Summary:
    policy: str
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    later_turn_p50_s: float
    """Turns 2 and later."""
    hit_rate: float
    """Cached prompt tokens / prompt tokens."""
    oracle_hit_rate: float
    """The same with one unlimited cache shared by all replicas."""
    max_mean_queued: float
    """Busiest replica's time-averaged queued prefill tokens / the replicas' mean (the queue
    integrated exactly over the run, not sampled at polls)."""
    mean_queued: float
    """The replicas' mean time-averaged queued prefill tokens: the scale of the ratio above."""
    max_mean_outstanding: float
    """The same for running + waiting requests."""
    max_mean_busy: float
    """Busiest replica's busy time / the replicas' mean."""

    @property
    def hit_vs_oracle(self) -> float:
        return self.hit_rate / self.oracle_hit_rate if self.oracle_hit_rate else 0.0


def summarise(policy: str, r: SimResult) -> Summary:
    ttft = [x.ttft_s for x in r.records]
    later = [x.ttft_s for x in r.records if x.turn > 0]
    prompt = sum(x.prompt_tokens for x in r.records) or 1

    def ratio(samples: dict[str, list[int]]) -> float:
        means = [sum(v) / len(v) if v else 0.0 for v in samples.values()]
        mean = sum(means) / len(means) if means else 0.0
        return max(means) / mean if mean else 1.0

    queued = [v / r.end_s if r.end_s else 0.0 for v in r.queued_token_s.values()]
    mean_q = sum(queued) / len(queued) if queued else 0.0
    busy = list(r.busy_s.values())
    mean_b = sum(busy) / len(busy) if busy else 0.0
    return Summary(
        policy,
        len(r.records),
        percentile(ttft, 0.5),
        percentile(ttft, 0.99),
        percentile(later, 0.5),
        sum(x.cached_tokens for x in r.records) / prompt,
        sum(x.oracle_tokens for x in r.records) / prompt,
        max(queued) / mean_q if mean_q else 1.0,
        mean_q,
        ratio(r.outstanding_samples),
        max(busy) / mean_b if mean_b else 1.0,
    )


HEADER = (
    "| workload | policy | TTFT p50 (s) | TTFT p99 (s) | turn 2+ p50 (s) | p50 / rr | p99 / rr | "
    "hit rate | oracle | hit / oracle | mean queued | max/mean queued | max/mean requests | "
    "max/mean busy |"
)


def table_rows(workload: str, summaries: list[Summary]) -> list[str]:
    rr = next((s for s in summaries if s.policy == "round_robin"), None)
    rows = []
    for s in summaries:
        r50 = f"{s.ttft_p50_s / rr.ttft_p50_s:.2f}" if rr and rr.ttft_p50_s else "-"
        r99 = f"{s.ttft_p99_s / rr.ttft_p99_s:.2f}" if rr and rr.ttft_p99_s else "-"
        rows.append(
            f"| {workload} | {s.policy} | {s.ttft_p50_s:.3f} | {s.ttft_p99_s:.3f} | "
            f"{s.later_turn_p50_s:.3f} | {r50} | {r99} | {s.hit_rate:.1%} | "
            f"{s.oracle_hit_rate:.1%} | {s.hit_vs_oracle:.1%} | {s.mean_queued:.1f} | "
            f"{s.max_mean_queued:.2f} | "
            f"{s.max_mean_outstanding:.2f} | "
            f"{s.max_mean_busy:.2f} |"
        )
    return rows
