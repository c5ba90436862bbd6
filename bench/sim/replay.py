"""A measured `deja bench router` run replayed in the simulator: simulated vs measured TTFT.

The simulated cluster gets the run's own requests: each turn's token ids (the workload's prompt
with the answers the real replicas generated, so block hashes match), the answer's length, and
the moment the client sent it (open loop at the measured send times: the real client's arrival
process and concurrency cap are already in them). Replicas, router poll interval and cost
weights are the run's; the step costs are the simulator's cost model, by default fitted on this
machine just before (`bench/sim/calibrate.py`, one thread on one core, as the replicas run). The
figures compared are TTFT p50 and p99 over all turns and over turns 2+, and the hit rate.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from bench.sim.cluster import Cluster, RequestRecord
from bench.sim.profile import CPU, CostModel
from bench.sim.report import percentile
from bench.sim.workload import Session as SimSession
from bench.sim.workload import Turn, Workload
from service.router.cost import CostWeights

BOUND = 0.25
"""Simulated TTFT p50 within this share of the measured one."""

_FIT_KEYS = (
    "step_overhead_s",
    "prefill_token_s",
    "prefill_pair_s",
    "decode_seq_s",
    "context_token_s",
)


def trace_workload(
    sessions: Sequence[Any],
    records: Sequence[Any],
    served_ids: Callable[[list[int]], list[int]] | None = None,
) -> Workload:
    """One measured round (bench.workload sessions and their `Record`s) as a simulator workload.

    Turn t's prompt is the session's prefix, every earlier user message and measured answer, and
    user message t, as the client built it; a session ends at its first failed request (the
    client sent nothing after it). `served_ids` maps such a prompt to the ids the replica
    computed when the client sent it as chat text (the chat template over the decoded
    history); a turn is then hashed on its own, since the template's tail keeps one turn's
    prompt from being a prefix of the next."""
    by_turn = {(r.session, r.turn): r for r in records}
    t0 = min((r.sent_at for r in records), default=0.0)
    out: list[SimSession] = []
    for i, s in enumerate(sessions):
        history = list(s.prefix)
        sim = SimSession(f"s{i}", growing=served_ids is None)
        for t, user in enumerate(s.turns, start=1):
            rec = by_turn.get((i, t))
            if rec is None or rec.error is not None:
                break
            prompt = history + user
            if len(prompt) != rec.prompt_tokens:
                raise ValueError(
                    f"session {i} turn {t}: the record's prompt has {rec.prompt_tokens} tokens, "
                    f"the workload's {len(prompt)}: not this workload's record"
                )
            served = prompt if served_ids is None else served_ids(prompt)
            sim.turns.append(Turn(served, list(rec.output_ids), arrival=rec.sent_at - t0))
            history = prompt + list(rec.output_ids)
        if sim.turns:
            out.append(sim)
    n = sum(len(s.turns) for s in out)
    span = max((t.arrival or 0.0 for s in out for t in s.turns), default=0.0)
    rate = n / span if span > 0 else 0.0
    return Workload("trace", out, rate, f"{n} measured requests over {span:.1f} s")


def model_for_replicas(base: CostModel, server_args: str) -> CostModel:
    """`base` with the scheduler limits and cache blocks the replicas ran with: `--server-args`
    parsed by `deja serve`'s own engine flags, the engine's defaults where not given (the device
    blocks: `base`'s, the default memory's blocks on the model it was fitted on)."""
    from service.common.engine_args import add_engine_args

    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    known, _ = p.parse_known_args(shlex.split(server_args))
    changes: dict[str, Any] = {
        "max_num_seqs": known.max_num_seqs,
        "step_tokens": known.max_num_batched_tokens,
        "block_size": known.block_size,
    }
    if known.num_device_blocks:
        changes["device_blocks"] = known.num_device_blocks
    return replace(base, **changes)


def model_from_fit(fit: dict[str, float], source: str, base: CostModel = CPU) -> CostModel:
    """`base` with the five step costs of a calibration fit."""
    costs: dict[str, Any] = {k: float(fit[k]) for k in _FIT_KEYS}
    return replace(base, name="calibrated", source=source, **costs)


def calibrate(model: str, core: str | None) -> CostModel:
    """Fits the step costs on this machine now: `bench/sim/calibrate.py` in a child process
    (one torch thread; pinned to `core` when given, as the replicas are)."""
    argv = [sys.executable, "-m", "bench.sim.calibrate", model]
    if core is not None:
        argv = ["taskset", "-c", core, *argv]
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    fit = json.loads(done.stdout)["fit"]
    where = f"core {core}" if core is not None else "unpinned"
    return model_from_fit(fit, f"fitted just before the run ({model}, one thread, {where})")


@dataclass(frozen=True, slots=True)
class Figures:
    """TTFT percentiles (seconds) and hit rate of one set of requests."""

    requests: int
    p50_s: float
    p99_s: float
    later_p50_s: float
    later_p99_s: float
    hit_rate: float


def _figures(ttft: list[tuple[int, float]], cached: int, prompt: int) -> Figures:
    """`ttft`: (1-based turn, seconds) of each request."""
    every = [s for _, s in ttft]
    later = [s for t, s in ttft if t > 1]
    return Figures(
        len(every),
        percentile(every, 0.5),
        percentile(every, 0.99),
        percentile(later, 0.5),
        percentile(later, 0.99),
        cached / prompt if prompt else 0.0,
    )


def measured_figures(records: Sequence[Any]) -> Figures:
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    return _figures(
        [(r.turn, r.ttft_s) for r in ok],
        sum(r.cached_tokens for r in ok),
        sum(r.prompt_tokens for r in ok),
    )


def simulated_figures(records: Sequence[RequestRecord]) -> Figures:
    return _figures(
        [(r.turn + 1, r.ttft_s) for r in records],
        sum(r.cached_tokens for r in records),
        sum(r.prompt_tokens for r in records),
    )


def replay(
    rounds: Sequence[tuple[Sequence[Any], Sequence[Any]]],
    *,
    model: CostModel,
    num_replicas: int,
    policy: str,
    poll_interval_s: float,
    weights: CostWeights | None,
    served_ids: Callable[[list[int]], list[int]] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Every measured round, each on a fresh simulated cluster: their requests together, and
    the simulated replicas' busy seconds (time in steps) over all rounds."""
    out: list[RequestRecord] = []
    busy = 0.0
    for sessions, records in rounds:
        cluster = Cluster(
            model, num_replicas, policy, poll_interval_s=poll_interval_s, weights=weights
        )
        out += cluster.run(trace_workload(sessions, records, served_ids)).records
        busy += sum(r.busy_s for r in cluster.replicas.values())
    return out, busy


def scaled(model: CostModel, factor: float) -> CostModel:
    """`model` with every step cost multiplied by `factor`."""
    costs: dict[str, Any] = {k: factor * getattr(model, k) for k in _FIT_KEYS}
    return replace(model, **costs)


def fit_busy_scale(
    busy_at: Callable[[float], float], measured_busy_s: float, *, tries: int = 4
) -> float:
    """The factor on the step costs at which the simulated replicas are busy as long as the real
    ones were (`busy_at(factor)`: the replay's busy seconds at that factor), by fixed-point
    iteration (busy time is not linear in the factor: dearer steps batch more); 1.0 when
    nothing was measured.

    The engine-only calibration prices a step on a core of its own; a real replica's step also
    loses its core to the replica's API process (streaming, tokenizing), which only the
    replica's own busy time shows."""
    if not measured_busy_s > 0:
        return 1.0
    factor = 1.0
    for _ in range(tries):
        busy = busy_at(factor)
        if not busy > 0:
            return 1.0
        if abs(busy / measured_busy_s - 1) < 0.01:
            break
        factor *= measured_busy_s / busy
    return factor


def format_comparison(rows: dict[str, tuple[Figures, Figures]]) -> str:
    """policy -> (measured, simulated), with simulated / measured ratios."""
    lines = [
        "== simulated vs measured (the same requests replayed; TTFT in ms, sim/real) ==",
        f"{'policy':<12}{'':<5}{'p50':>9}{'p99':>9}{'p50 2+':>9}{'p99 2+':>9}{'hit':>7}",
    ]
    for policy, (real, sim) in rows.items():
        for label, f in (("real", real), ("sim", sim)):
            lines.append(
                f"{policy:<12}{label:<5}{1e3 * f.p50_s:9.1f}{1e3 * f.p99_s:9.1f}"
                f"{1e3 * f.later_p50_s:9.1f}{1e3 * f.later_p99_s:9.1f}{100 * f.hit_rate:6.1f}%"
            )

        def ratio(a: float, b: float) -> str:
            return f"{b / a:9.2f}" if a else f"{'-':>9}"

        lines.append(
            f"{policy:<12}{'x':<5}{ratio(real.p50_s, sim.p50_s)}{ratio(real.p99_s, sim.p99_s)}"
            f"{ratio(real.later_p50_s, sim.later_p50_s)}"
            f"{ratio(real.later_p99_s, sim.later_p99_s)}"
        )
        ok = real.p50_s > 0 and abs(sim.p50_s / real.p50_s - 1) <= BOUND
        lines.append(
            f"{policy}: simulated TTFT p50 within {BOUND:.0%} of the measured: "
            + ("MET" if ok else "NOT MET")
        )
    return "\n".join(lines)


def router_settings(router_args: str, poll_interval_s: float) -> tuple[float, CostWeights]:
    """The poll interval and cost weights `deja route` ran with (`--router-args` over the
    bench's own `--poll-interval`)."""
    from service.router.config import add_cost_args, cost_weights_from_args

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--poll-interval", type=float, default=poll_interval_s)
    add_cost_args(p.add_argument_group("cost"))
    known, _ = p.parse_known_args(shlex.split(router_args))
    return known.poll_interval, cost_weights_from_args(known)


def sim_model(profile: str, model: str, server_args: str, core: str | None) -> CostModel:
    """The simulated replicas' cost model for `--sim-profile` (see bench/router.py)."""
    if profile == "calibrate":
        base = calibrate(model, core)
    elif profile == "cpu":
        base = CPU
    else:
        with open(profile) as f:
            base = model_from_fit(json.load(f)["fit"], profile)
    return model_for_replicas(base, server_args)


def chat_served_ids(tokenizer: Any, messages_of: Callable[[list[int]], Any]) -> Callable[..., Any]:
    """`trace_workload`'s `served_ids` for a run that sent chat text: the replicas computed the
    chat template over the history decoded into one user message (`messages_of`)."""
    from engine.frontend.prompt import apply_chat_template

    def served_ids(prompt: list[int]) -> list[int]:
        return apply_chat_template(tokenizer, messages_of(prompt))

    return served_ids
