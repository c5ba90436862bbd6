"""Measured step costs a replica publishes for the router's cost policy.

Every step's wall time is modelled as

    seconds = overhead_s + prefill_token_s * P + decode_seq_s * B

(P prefill tokens, B decoding sequences) and the three coefficients are fitted by exponentially
weighted least squares over the recent steps (forgetting factor `1 - alpha`, ~1/alpha steps of
memory). What is published:

- `decode_seq_s`: what each running decode adds to a step;
- `prefill_tokens_per_s`: 1 / `prefill_token_s`;
- `overhead_s`: the cost of a step whatever it carries.
Each is 0.0 until the steps seen determine it (a decode step for `decode_seq_s`, a prefill step
for the prefill rate).

Why a joint fit: the first version averaged `seconds / B` over decode-only steps and took those
decodes' share out of prefill steps. The step overhead then counted as decode cost, so one
decoding sequence looked ten times as expensive as eight, and the prefill rate of two identical
replicas on this machine read 54 and 156 tokens/s in the same run (bench router); the
router sent the "faster" replica more work. A joint fit separates the three costs.

And `utilisation(now)`: the share of the last ~`window_s` seconds spent in steps (exponentially
decayed), which reflects the sessions a replica is home to even while they are between turns.
NOTE: the window is long against a session's life (a chat session of 6 turns and 5 s think time
lasts ~40 s) so that the figure counts whole sessions: at 30 s a replica of a 16-replica cluster
at 70 % load sees ~2 requests in the window, and the router's load bound followed that noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_RIDGE = 1e-6
"""Relative ridge on the normal equations: keeps a coefficient the steps do not determine yet
(say, the decode cost before any decode) at zero instead of at noise."""


@dataclass(slots=True)
class StepRates:
    alpha: float = 0.05
    """Weight of the newest step in the fit (1 - the forgetting factor)."""
    window_s: float = 120.0
    _xx: list[float] = field(default_factory=lambda: [0.0] * 9)
    """Decayed sum of x x^T over steps, x = (1, P, B), row-major 3 x 3."""
    _xy: list[float] = field(default_factory=lambda: [0.0] * 3)
    """Decayed sum of x * seconds."""
    _coef: tuple[float, float, float] | None = None
    """(overhead_s, prefill_token_s, decode_seq_s), solved lazily; None: stale."""
    prefill_steps: int = 0
    """Steps seen that carried prefill tokens."""
    decode_steps: int = 0
    """Steps seen that carried decodes."""
    _busy_s: float = 0.0
    """Step seconds, decayed with time constant `window_s`, as of `_busy_at`."""
    _busy_at: float = 0.0
    _last_done: float = 0.0
    """When the last step with scheduled tokens completed (monotonic seconds)."""
    total_busy_s: float = 0.0
    """Wall seconds of whole steps since start, as the step loop times them (`count_busy`:
    scheduling and output processing included, unlike `observe`'s), not decayed."""
    total_steps: int = 0
    """Steps counted by `count_busy` since start."""

    def utilisation(self, now: float) -> float:
        decay = math.exp(-max(0.0, now - self._busy_at) / self.window_s)
        return min(1.0, self._busy_s * decay / self.window_s)

    def observe_step(
        self, counts: tuple[int, int], scheduled_at: float, now: float, deferred: bool
    ) -> None:
        """A completed step's sample: (prefill tokens, decode sequences) over the time since it
        was scheduled; a step left in flight (`deferred`) overlapped the step before, so its time
        starts where that one ended."""
        prefill, decodes = counts
        if not (prefill or decodes):
            return
        start = max(scheduled_at, self._last_done) if deferred else scheduled_at
        self.observe(prefill, decodes, now - start, now)
        self._last_done = now

    def count_busy(self, seconds: float) -> None:
        """One whole step of the step loop took `seconds` (wall)."""
        self.total_busy_s += seconds
        self.total_steps += 1

    def observe(
        self, prefill_tokens: int, decode_seqs: int, seconds: float, now: float | None = None
    ) -> None:
        if seconds <= 0:
            return
        if now is not None:
            decay = math.exp(-max(0.0, now - self._busy_at) / self.window_s)
            self._busy_s = self._busy_s * decay + seconds
            self._busy_at = now
        if prefill_tokens <= 0 and decode_seqs <= 0:
            return
        self.prefill_steps += prefill_tokens > 0
        self.decode_steps += decode_seqs > 0
        keep = 1.0 - self.alpha
        x = (1.0, float(max(0, prefill_tokens)), float(max(0, decode_seqs)))
        xx, xy = self._xx, self._xy
        for i in range(3):
            xy[i] = keep * xy[i] + x[i] * seconds
            for j in range(3):
                xx[3 * i + j] = keep * xx[3 * i + j] + x[i] * x[j]
        self._coef = None

    @property
    def overhead_s(self) -> float:
        return self._solved()[0]

    @property
    def prefill_tokens_per_s(self) -> float:
        per_token = self._solved()[1]
        return 1.0 / per_token if per_token > 0 else 0.0

    @property
    def decode_seq_s(self) -> float:
        return self._solved()[2]

    def _solved(self) -> tuple[float, float, float]:
        if self._coef is None:
            self._coef = _fit(self._xx, self._xy)
        return self._coef


def _fit(xx: list[float], xy: list[float]) -> tuple[float, float, float]:
    """Non-negative least squares over the three costs: the full fit, else the best fit with
    one or two of them held at zero (a negative coefficient means the steps cannot tell it from
    the others yet)."""
    best: tuple[float, float, float] = (0.0, 0.0, 0.0)
    best_err = math.inf
    for active in ((0, 1, 2), (1, 2), (0, 1), (0, 2), (1,), (2,), (0,)):
        coef = _solve(xx, xy, active)
        if coef is None or min(coef) < 0:
            continue
        # Residual sum of squares up to a constant: c^T XX c - 2 c^T XY.
        err = sum(coef[i] * xx[3 * i + j] * coef[j] for i in range(3) for j in range(3))
        err -= 2 * sum(coef[i] * xy[i] for i in range(3))
        if err < best_err - 1e-15:
            best, best_err = coef, err
    return best


def _solve(
    xx: list[float], xy: list[float], active: tuple[int, ...]
) -> tuple[float, float, float] | None:
    """The least-squares coefficients of the `active` features (the others zero), by Gaussian
    elimination on the (ridged) normal equations; None if they are singular."""
    n = len(active)
    a = [[xx[3 * i + j] for j in active] + [xy[i]] for i in active]
    for k in range(n):
        a[k][k] += _RIDGE * a[k][k]
        if a[k][k] <= 0:
            return None
    for k in range(n):
        piv = max(range(k, n), key=lambda r: abs(a[r][k]))
        if abs(a[piv][k]) < 1e-18:
            return None
        a[k], a[piv] = a[piv], a[k]
        for r in range(n):
            if r != k:
                f = a[r][k] / a[k][k]
                a[r] = [v - f * w for v, w in zip(a[r], a[k], strict=True)]
    out = [0.0, 0.0, 0.0]
    for k, i in enumerate(active):
        out[i] = a[k][n] / a[k][k]
    return (out[0], out[1], out[2])
