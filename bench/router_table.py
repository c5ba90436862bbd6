"""`deja bench router`'s table: each policy's hit rates and TTFT, and its ratios to round robin."""

from __future__ import annotations

from typing import Any


def _row(r: dict[str, Any]) -> dict[str, Any]:
    later = r.get("turns_2plus", r)
    return {
        "hit_rate": r["prefix_hit_rate"],
        "hit_rate_turns_2plus": later["prefix_hit_rate"],
        "oracle_hit_rate": r["oracle_hit_rate"],
        "ttft_p50_ms": r["ttft_ms"].get("p50"),
        "ttft_p99_ms": r["ttft_ms"].get("p99"),
        "ttft_p50_ms_turns_2plus": later["ttft_ms"].get("p50"),
        "ttft_p99_ms_turns_2plus": later["ttft_ms"].get("p99"),
    }


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per policy: hit rates (and the oracle's, the most any policy can cache), TTFT p50/p99
    (all, turns 2+), and ratios to round robin (TTFT: round robin's / this policy's, so > 1 is
    faster; hit rate: this policy's / round robin's)."""
    rows = {policy: _row(r) for policy, r in results.items()}
    base = rows.get("round_robin")
    if base is not None:
        for row in rows.values():
            vs: dict[str, float | None] = {
                k: (base[k] / v if v and base[k] else None)
                for k, v in row.items()
                if k.startswith("ttft")
            }
            vs["hit_rate"] = row["hit_rate"] / base["hit_rate"] if base["hit_rate"] else None
            row["vs_round_robin"] = vs
    return rows


def format_comparison(rows: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return f"{v:9.1f}" if v is not None else f"{'-':>9}"

    lines = [
        "== routing policies (TTFT in ms; x = round robin's TTFT / this policy's) ==",
        f"{'policy':<24}{'hit':>7}{'hit 2+':>8}{'p50':>9}{'p99':>9}{'p50 2+':>9}{'p99 2+':>9}"
        f"{'x p50':>8}{'x p99':>8}{'x p50 2+':>10}{'x hit':>7}{'oracle':>8}",
    ]
    for policy, row in rows.items():
        vs = row.get("vs_round_robin", {})

        def ratio(key: str, vs: dict[str, Any] = vs) -> str:
            v = vs.get(key)
            return f"{v:.2f}" if v else "-"

        lines.append(
            f"{policy:<24}{100 * row['hit_rate']:6.1f}%{100 * row['hit_rate_turns_2plus']:7.1f}%"
            f"{ms(row['ttft_p50_ms'])}{ms(row['ttft_p99_ms'])}"
            f"{ms(row['ttft_p50_ms_turns_2plus'])}{ms(row['ttft_p99_ms_turns_2plus'])}"
            f"{ratio('ttft_p50_ms'):>8}{ratio('ttft_p99_ms'):>8}"
            f"{ratio('ttft_p50_ms_turns_2plus'):>10}{ratio('hit_rate'):>7}"
            f"{100 * row['oracle_hit_rate']:7.1f}%"
        )
    base = rows.get("round_robin")
    if base is not None and base["hit_rate"]:
        best = max(row["oracle_hit_rate"] for row in rows.values()) / base["hit_rate"]
        lines.append(
            "oracle: one replica with an unlimited cache; no policy's hit rate can exceed it, "
            f"so none can reach more than {best:.2f}x round robin's here"
        )
    return "\n".join(lines)


def route_counts(metrics_text: str, label: str) -> dict[str, float]:
    """deja_router_requests_total summed by one label (reason or replica)."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("deja_router_requests_total{"):
            labels, _, value = line.partition("} ")
            key = labels.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out
