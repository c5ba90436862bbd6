"""PNG plots of the benchmarks' results (`--plot PATH`; matplotlib, the `plots` extra).

- `ttft_by_turn`: `deja bench serve` on a multi-turn workload, TTFT p50 (and p90) per turn, one
  line per server variant (cache on, cache off, remote tier).
- `ttft_distributions`: `deja bench router`, the TTFT of every request per routing policy
  (box plots, turns 2+ beside all turns).
- `sweep`: `deja bench serve --sweep-concurrency`, served (and offline) output throughput and
  served TPOT p50 against concurrency.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'deja[plots]' (or matplotlib==3.11.2)"
        ) from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")
    return path


def ttft_by_turn(results: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> Path:
    """results: variant -> a `summarize_by_turn` result with `ttft_ms_by_turn`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        by_turn = r.get("ttft_ms_by_turn") or {}
        turns = sorted(int(t) for t in by_turn)
        if not turns:
            continue
        p50 = [by_turn[str(t)]["p50"] for t in turns]
        p90 = [by_turn[str(t)]["p90"] for t in turns]
        (line,) = ax.plot(turns, p50, marker="o", label=f"{name} p50")
        ax.plot(turns, p90, linestyle="--", color=line.get_color(), label=f"{name} p90")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (ms)")
    ax.set_xticks(sorted({int(t) for r in results.values() for t in r.get("ttft_ms_by_turn", {})}))
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def ttfts(records: Mapping[str, Sequence[Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """name -> (TTFTs in ms of all its requests, of turns 2+), from `bench.workload.Record`s."""
    out = {}
    for name, recs in records.items():
        ok = [r for r in recs if r.error is None and r.ttft_s is not None]
        out[name] = ([1e3 * r.ttft_s for r in ok], [1e3 * r.ttft_s for r in ok if r.turn > 1])
    return out


def ttft_distributions(
    samples: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: Path | str,
    title: str = "TTFT by routing policy",
) -> Path:
    """samples: policy -> (TTFTs in ms of all requests, of turns 2+) (`ttfts`)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    names = list(samples)
    for ax, which, label in ((axes[0], 0, "all turns"), (axes[1], 1, "turns 2+")):
        data = [list(samples[n][which]) or [0.0] for n in names]
        ax.boxplot(data, tick_labels=names, showfliers=True, whis=(5, 95))
        ax.set_title(f"{title}: {label}")
        ax.set_ylabel("time to first token (ms)")
        ax.tick_params(axis="x", rotation=20)
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def sweep(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """rows: `bench.sweep.sweep_rows`' (concurrency, served/offline throughput, TPOT)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    levels = [r["concurrency"] for r in rows]
    left.plot(
        levels, [r["served_output_tok_s"] for r in rows], marker="o", label="deja served (gRPC)"
    )
    offline = [r.get("offline_output_tok_s") for r in rows]
    if any(v is not None for v in offline):
        left.plot(levels, offline, marker="s", label="deja offline engine")
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrency")
    left.set_ylabel("output tokens / s")
    left.set_title(f"{title}: throughput")
    right.plot(levels, [r.get("served_tpot_p50_ms") for r in rows], marker="o", label="deja served")
    right.set_xscale("log", base=2)
    right.set_xlabel("concurrency")
    right.set_ylabel("TPOT p50 (ms)")
    right.set_title(f"{title}: time per output token")
    for ax in (left, right):
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)
