"""Prompt lookup: where the last tokens of a sample occurred before, and what followed them.

`TokenIndex` keeps, for one growing token list (a sample's prompt and output), the end position
of every n-gram of length `key_len` (prompt_lookup_min), and extends itself as tokens arrive.
A lookup takes the sample's last `key_len` tokens, walks the earlier places they occur (most
recent first, at most `MAX_CANDIDATES`), measures how far back each one keeps matching (up to
prompt_lookup_max) and returns the longest match with the tokens that followed it. vLLM's n-gram
proposer and llama.cpp's prompt lookup do the same; the most recent occurrence wins a tie
because, in chat, the latest turn is the one an answer quotes.

`Corpus` (engine/core/spec/suffix.py) indexes several documents with the same keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

MAX_CANDIDATES = 16
"""Earlier occurrences of the key compared per lookup (most recent first)."""
MAX_PER_KEY = 64
"""Occurrences kept per key (the oldest are dropped): bounds a lookup's work on repetitive text."""


@dataclass(slots=True)
class Match:
    """The longest earlier occurrence of a sample's suffix."""

    length: int
    """Tokens matched (>= key_len)."""
    continuation: list[int]
    """The tokens that followed it (at most the number asked for)."""


def match_length(doc: Sequence[int], end: int, ctx: Sequence[int], limit: int) -> int:
    """How many tokens before and at doc[end] equal the last tokens of ctx (at most `limit`)."""
    n, last = 0, len(ctx) - 1
    while n < limit and end - n >= 0 and doc[end - n] == ctx[last - n]:
        n += 1
    return n


def add_end(ends: dict[tuple[int, ...], list[T]], key: tuple[int, ...], end: T) -> None:
    """Records one more place `key` ends (the oldest go past MAX_PER_KEY)."""
    found = ends.get(key)
    if found is None:
        ends[key] = [end]
    else:
        found.append(end)
        if len(found) > MAX_PER_KEY:
            del found[0]


def longest_match(
    places: Iterable[tuple[Sequence[int], int]], ctx: Sequence[int], max_len: int
) -> tuple[int, Sequence[int], int]:
    """Of the places (doc, end) where ctx's last key ends, most recent first: the longest match
    (the first on a tie) as (length, doc, end); length 0 when there are none."""
    best: tuple[int, Sequence[int], int] = (0, ctx, -1)
    for doc, end in places:
        m = match_length(doc, end, ctx, max_len)
        if m > best[0]:
            best = (m, doc, end)
            if m == max_len:
                break
    return best


@dataclass(slots=True)
class TokenIndex:
    """End positions of every `key_len`-gram of one token list, built as the list grows."""

    key_len: int
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    indexed: int = 0
    """Positions below this are indexed (as n-gram ends)."""

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Indexes the n-grams ending before position `upto`."""
        n = self.key_len
        ends = self.ends
        for p in range(max(self.indexed, n - 1), upto):
            add_end(ends, tuple(tokens[p - n + 1 : p + 1]), p)
        self.indexed = max(self.indexed, upto)

    def lookup(self, tokens: Sequence[int], max_len: int, num_tokens: int) -> Match | None:
        """The longest earlier match of `tokens`' suffix (its own last position excluded) and
        up to `num_tokens` tokens after it; None when the last key_len tokens never occurred."""
        n = self.key_len
        last = len(tokens) - 1
        if last < n:
            return None
        self.extend(tokens, last)  # every end but the suffix's own
        found = self.ends.get(tuple(tokens[last - n + 1 :]))
        if not found:
            return None
        places = ((tokens, end) for end in reversed(found[-MAX_CANDIDATES:]))
        length, _, end = longest_match(places, tokens, max_len)
        if length < n:
            return None
        return Match(length, list(tokens[end + 1 : end + 1 + num_tokens]))
