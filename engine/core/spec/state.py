"""One sample's speculative-decoding state (engine/core/spec/proposer.py decides with it);
`Sequence.draft` holds it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.spec.ngram import TokenIndex


@dataclass(slots=True)
class DraftState:
    """One sample's proposal state."""

    index: TokenIndex
    limit: int
    """Most tokens its next proposal may hold (adaptive, <= num_speculative_tokens)."""
    misses: int = 0
    """Fully rejected proposals in a row."""
    wait: int = 0
    """Steps left before it proposes again."""
