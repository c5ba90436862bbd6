"""How much of a router's recent traffic shares a prompt's leading blocks.

A prefix that a large share of the traffic starts with (a system prompt every session uses)
must be served by many replicas whoever holds it first; a prefix of a small share (one
customer's document) can stay on the replicas that hold it. The cost policy's holder exemption
(service/router/cost.py, `CostWeights.holder_share`) uses this: a holder is exempt from the load
bound only for a prefix whose traffic fits within one replica's share of the whole.

Counts are exponentially decayed request counts (`half_life_s`) per block hash, kept at a few
depths of each chain only: blocks 0, 1, 3, 7, ... (2^j - 1) and the last. A chain's blocks are
nested (a request containing block i contains every block before it), so the share at a
depth is at most the share at any shallower one; `share_at` answers with the deepest counted
depth at or above the one asked, an upper bound. Memory is capped (`max_entries`, least
recently counted first out).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from engine.kv.hashing import BlockHash


def counted_depths(num_blocks: int) -> list[int]:
    """The chain indices counted for a chain of `num_blocks` blocks: 2^j - 1, and the last."""
    depths = []
    d = 1
    while d - 1 < num_blocks:
        depths.append(d - 1)
        d *= 2
    if num_blocks and depths[-1] != num_blocks - 1:
        depths.append(num_blocks - 1)
    return depths


class PrefixPopularity:
    """Decayed counts of recent requests per leading block (see the module docstring)."""

    def __init__(self, half_life_s: float = 60.0, max_entries: int = 100_000) -> None:
        if half_life_s <= 0 or max_entries < 1:
            raise ValueError("half_life_s must be > 0 and max_entries >= 1")
        self._rate = math.log(2) / half_life_s
        self._max = max_entries
        self._counts: OrderedDict[BlockHash, tuple[float, float]] = OrderedDict()
        """Block hash -> (decayed count, when it was last updated)."""
        self._total = (0.0, 0.0)

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        value, t = entry
        return value * math.exp(-self._rate * max(0.0, now - t))

    def observe(self, chain: Sequence[BlockHash], now: float) -> None:
        """Counts one request whose prompt has these leading blocks."""
        self.track(chain, now)

    def shares(self, chain: Sequence[BlockHash], now: float) -> tuple[tuple[int, float], ...]:
        """(depth, share of recent requests containing the chain up to that block) at the
        counted depths, shallowest first."""
        total = self._decayed(self._total, now)
        if total <= 0:
            return ()
        out = []
        for d in counted_depths(len(chain)):
            entry = self._counts.get(chain[d])
            out.append((d, min(1.0, self._decayed(entry, now) / total) if entry else 0.0))
        return tuple(out)

    def track(self, chain: Sequence[BlockHash], now: float) -> tuple[tuple[int, float], ...]:
        """`shares` of this request's chain as the traffic before it, and it counted (as
        `observe`), in one pass over the chain."""
        prior = self._decayed(self._total, now)
        self._total = (prior + 1.0, now)
        out = []
        for d in counted_depths(len(chain)):
            h = chain[d]
            old = self._counts.pop(h, None)
            count = self._decayed(old, now) if old else 0.0
            if prior > 0:
                out.append((d, min(1.0, count / prior)))
            self._counts[h] = (count + 1.0, now)
        while len(self._counts) > self._max:
            self._counts.popitem(last=False)
        return tuple(out)


def share_at(shares: Sequence[tuple[int, float]], depth: int) -> float | None:
    """The share of requests containing the chain's first `depth + 1` blocks, bounded from above
    by the deepest counted depth at or above it; None when nothing at or above it was counted."""
    best = None
    for d, s in shares:
        if d > depth:
            break
        best = s
    return best
