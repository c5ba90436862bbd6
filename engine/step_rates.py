"""Measured step costs a replica publishes for the router's cost policy.

From each step's wall time, its prefill tokens and its decoding sequences, two moving averages:

- `decode_seq_s`: seconds per decoding sequence, from steps that only decode (step overhead
  included, shared by the batch): what each running decode adds to a step;
- `prefill_tokens_per_s`: prefill tokens per second, from steps with prefill work, after taking
  the decodes' share (`decode_seq_s` each) out of the step time.
Both are exponential moving averages with weight `alpha` for the newest step; 0.0 until seen.
And `utilisation(now)`: the share of the last ~`window_s` seconds spent in steps (exponentially
decayed), which reflects the sessions a replica is home to even while they are between turns.
NOTE: the window is long against a session's life (a chat session of 6 turns and 5 s think time
lasts ~40 s) so that the figure counts whole sessions: at 30 s a replica of a 16-replica cluster
at 70 % load sees ~2 requests in the window, and the router's load bound followed that noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class StepRates:
    alpha: float = 0.1
    decode_seq_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    window_s: float = 120.0
    _busy_s: float = 0.0
    """Step seconds, decayed with time constant `window_s`, as of `_busy_at`."""
    _busy_at: float = 0.0

    def utilisation(self, now: float) -> float:
        decay = math.exp(-max(0.0, now - self._busy_at) / self.window_s)
        return min(1.0, self._busy_s * decay / self.window_s)

    def observe(
        self, prefill_tokens: int, decode_seqs: int, seconds: float, now: float | None = None
    ) -> None:
        if seconds <= 0:
            return
        if now is not None:
            decay = math.exp(-max(0.0, now - self._busy_at) / self.window_s)
            self._busy_s = self._busy_s * decay + seconds
            self._busy_at = now
        if prefill_tokens <= 0:
            if decode_seqs > 0:
                self.decode_seq_s = self._avg(self.decode_seq_s, seconds / decode_seqs)
            return
        prefill_s = seconds - decode_seqs * self.decode_seq_s
        if prefill_s <= 0.1 * seconds:  # the decode estimate is off; this step says little
            prefill_s = 0.1 * seconds
        self.prefill_tokens_per_s = self._avg(self.prefill_tokens_per_s, prefill_tokens / prefill_s)

    def _avg(self, old: float, new: float) -> float:
        return new if old <= 0 else old + self.alpha * (new - old)
