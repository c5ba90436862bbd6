"""Random prompts for the tiny test models (token ids inside every tiny vocabulary)."""

from __future__ import annotations

import random


def rand_tokens(n: int, seed: int) -> list[int]:
    """`n` token ids in [10, 400), the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(10, 400) for _ in range(n)]
