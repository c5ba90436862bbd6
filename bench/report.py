"""What the benchmarks print and write: machine and load-average lines, tables, ratios, JSON.

Every benchmark prints what it ran on (`print_header`, or `cuda_device` on a GPU) and the load
average at the end (`finish_info` / `finish_line`): on a shared machine a busy run reads as one.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


# -- the machine -------------------------------------------------------------------------------
def machine_info(threads: int | None) -> dict[str, Any]:
    """What the figures were measured on."""
    import torch
    import transformers

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_flags": cpu_flags(),
        "load_avg_at_start": load_avg(),
        "cpu_times_at_start": cpu_times(),
    }


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(info: dict[str, Any]) -> str:
    """ "machine: <cpu>, <n> cores, cpu flags: ..." from `info`'s cpu, cores and cpu_flags."""
    flags = info.get("cpu_flags") or "unknown"
    return f"machine: {info['cpu']}, {info['cores']} cores, cpu flags: {flags}"


SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
"""The CPU features that decide which kernels oneDNN can use (bfloat16 units above all)."""


def cpu_flags() -> str:
    """Which of SPEED_FLAGS the CPU has, e.g. "avx2 avx512f avx512_bf16" ("" if unknown)."""
    from engine.worker.cpu_features import cpu_flags as all_flags

    have = all_flags()
    return " ".join(flag for flag in SPEED_FLAGS if flag in have)


def cuda_device(command: str) -> Any | None:
    """The properties of CUDA device 0; None, saying that `command` needs one, when there is
    none."""
    import torch

    if not torch.cuda.is_available():
        print(f"{command} needs a CUDA GPU; none is available")
        return None
    return torch.cuda.get_device_properties(0)


def load_avg() -> list[float]:
    """1, 5 and 15 minute load averages (empty where the OS has none)."""
    try:
        return list(os.getloadavg())
    except OSError:
        return []


def cpu_times() -> list[int]:
    """The machine's CPU time counters since boot, /proc/stat's first line (user, nice, system,
    idle, iowait, irq, softirq, steal, ...; empty where there is none)."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = f.readline().split()
    except OSError:
        return []
    if not fields or fields[0] != "cpu":
        return []
    return [int(x) for x in fields[1:]]


STEAL = 7
"""The steal counter's index in `cpu_times`: time the hypervisor gave this VM's CPUs to others."""
NOISY_STEAL = 0.05
"""A run with more steal than this is flagged: its figures move with the neighbours' load."""


def steal_share(start: Sequence[int], end: Sequence[int]) -> float | None:
    """The share of CPU time stolen by the hypervisor between two `cpu_times` readings (None
    without both, or without a steal counter)."""
    if len(start) <= STEAL or len(end) <= STEAL:
        return None
    # guest times (after steal) are already counted in user and nice
    total = sum(end[: STEAL + 1]) - sum(start[: STEAL + 1])
    return (end[STEAL] - start[STEAL]) / total if total > 0 else None


def format_load(values: Sequence[float]) -> str:
    """Load averages as the report lines print them: "0.52, 0.61, 0.70"."""
    return ", ".join(f"{x:.2f}" for x in values)


def finish_info(info: dict[str, Any]) -> str:
    """Records the load average at the end in `info`; returns a line saying whether the machine
    was busy with other work during the run (the figures are then noisier)."""
    end = load_avg()
    info["load_avg_at_end"] = end
    busy = bool(end) and end[1] > (os.cpu_count() or 1) + 0.5
    load = format_load(end)
    note = " (busy with other work: figures are noisy)" if busy else ""
    steal = steal_share(info.get("cpu_times_at_start", []), cpu_times())
    info["cpu_steal_share"] = steal
    if steal is not None:
        note += f", CPU steal {steal:.1%} during the run"
        if steal > NOISY_STEAL:
            note += " (the hypervisor gave this VM's CPUs to others: figures are noisy)"
    return f"load avg at end {load}{note}"


def finish_line(info: dict[str, Any]) -> str:
    """`finish_info`'s line, with the load average at the start (`info["load_avg_at_start"]`)."""
    return f"{finish_info(info)} (at start {format_load(info['load_avg_at_start'])})"


def print_header(title: str, model_path: str, info: dict[str, Any]) -> None:
    print(f"== {title} ==")
    print(f"model: {model_path}")
    load = format_load(info["load_avg_at_start"])
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} "
        f"({info['torch_threads']} threads), transformers {info['transformers']}, load avg {load}"
    )
    print(f"cpu flags: {info.get('cpu_flags') or 'unknown'}")


# -- figures -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Check:
    """One measured figure against its bound."""

    name: str
    value: float
    target: str
    """The bound as printed, e.g. ">= 0.95"."""
    ok: bool

    def line(self) -> str:
        met = "MET" if self.ok else "NOT MET"
        return f"{self.name}: {self.value:.2f} (bound {self.target}) {met}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> None:
    """A plain left-aligned text table (floats with `digits` decimals)."""

    def fmt(v: Any) -> str:
        return f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def ratio_line(what: str, value: float, digits: int = 2) -> str:
    """A ratio against a baseline as the benchmarks print it: "ratio ours / generate: 1.23x"."""
    return f"{what}: {value:.{digits}f}x"


# -- JSON --------------------------------------------------------------------------------------
def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    """The results (keys sorted) to `path` (--json), if given, saying so."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"results written to {path}")


def emit_report(report: dict[str, Any], output: str | None, as_json: bool) -> bool:
    """A load benchmark's report (`deja bench serve`, `deja bench router`): written to `output`
    (--output) if given, printed as JSON with --json. Returns whether it was printed (the text
    report is then left out, so that stdout is JSON alone)."""
    text = json.dumps(report, indent=2, default=str)
    if output:
        Path(output).write_text(text + "\n")
    if as_json:
        print(text)
    return as_json
