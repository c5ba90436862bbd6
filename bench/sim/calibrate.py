"""Measures a replica's step times to calibrate the simulator's cost model (`deja bench sim
--calibrate`): prefill steps of P new tokens and decode steps of B sequences, on the engine
directly (no server), then a least-squares fit of

    step_s = step_overhead_s + prefill_token_s * P + prefill_pair_s * A
             + decode_seq_s * B + context_token_s * C

where A counts (new token, earlier token) pairs of the prefill (P * P / 2 for a prompt from
scratch: attention) and C is the sum of the decoding sequences' context lengths, with one engine thread and the
process's CPU time (so a busy shared machine does not inflate it): the cost of a replica that
has one core to itself. Prints the rows and the fit.
"""

from __future__ import annotations

import random
import time
from typing import Any


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def measure(model_path: str, *, num_threads: int = 1) -> dict[str, Any]:
    """Rows of (prefill tokens, decode seqs, decode context tokens, seconds) and the fit."""

    from engine.config import EngineConfig
    from engine.frontend.llm_engine import LLMEngine
    from engine.sample.sampling_params import SamplingParams

    eng = LLMEngine(
        EngineConfig.from_kwargs(
            model_path,
            max_num_batched_tokens=2048,
            num_device_blocks=1024,
            num_threads=num_threads,
            enable_prefix_caching=False,
        )
    )
    rng = random.Random(0)
    rows: list[tuple[int, int, int, float]] = []

    def timed_step() -> float:
        # NOTE: CPU time of the process, not wall time: on a shared machine it is what the step
        # costs on one core of its own (the replica is pinned to one core, one thread).
        t = time.process_time()
        eng.step()
        return time.process_time() - t

    # warm-up
    eng.add_request(_prompt(rng, 64), SamplingParams(max_tokens=2))
    while eng.has_unfinished_requests():
        eng.step()
    for p in (32, 256, 1024, 2048):
        for _ in range(2):
            eng.add_request(_prompt(rng, p), SamplingParams(max_tokens=1))
            rows.append((p, 0, 0, timed_step()))
            while eng.has_unfinished_requests():
                eng.step()
    for b, ctx in ((1, 64), (8, 64), (32, 64), (8, 1024)):
        for _ in range(b):
            eng.add_request(_prompt(rng, ctx), SamplingParams(max_tokens=8, ignore_eos=True))
        while any(
            s.num_computed_tokens < s.num_prompt_tokens for s in eng.core.scheduler.running
        ) or (eng.core.scheduler.waiting):
            eng.step()
        for _ in range(4):
            rows.append((0, b, b * ctx, timed_step()))
        while eng.has_unfinished_requests():
            eng.step()
    return {"rows": rows, "fit": fit_rows(rows)}


def fit_rows(rows: list[tuple[int, int, int, float]]) -> dict[str, float]:
    """Least squares of the step model over (P, B, C, seconds) rows (prefills from scratch)."""
    import numpy as np

    x = np.array([[1.0, p, p * p / 2, b, c] for p, b, c, _ in rows])
    y = np.array([r[3] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    names = (
        "step_overhead_s",
        "prefill_token_s",
        "prefill_pair_s",
        "decode_seq_s",
        "context_token_s",
    )
    return {n: max(0.0, float(c)) for n, c in zip(names, coef, strict=True)}


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    from engine.demo import resolve_model_path

    path = resolve_model_path(
        sys.argv[1] if len(sys.argv) > 1 else "demo", Path("~/.cache/deja").expanduser()
    )
    out = measure(path)
    print(json.dumps(out, indent=1))
