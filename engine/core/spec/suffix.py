"""Suffix decoding's shared half: earlier requests' outputs, per tenant, to propose from.

Suffix decoding (Snowflake's ArcticInference; vLLM's method "suffix") proposes from the sample's
own text and from the outputs of earlier requests, so an answer that repeats an earlier answer
(agents, templated replies, the same question asked again) is verified many tokens a step.
`SuffixCache` keeps, for each tenant (a request's `hash_extra`: the model identity and the cache
salt, the same key that isolates the prefix cache), a bounded `Corpus` of finished samples:
each sample's output preceded by the prompt's last `key_len + max_len` tokens, so the output's
first tokens can be found from the end of a prompt. One tenant's corpus is never read for
another's requests. The oldest documents go first when a tenant holds
`suffix_decoding_max_cached_requests`.

Unlike ArcticInference's suffix tree, which weighs every continuation by how often it was seen,
the corpus proposes the continuation of the longest match (the most recent on a tie).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.spec.ngram import MAX_CANDIDATES, Match, add_end, longest_match


@dataclass(slots=True)
class Corpus:
    """Documents indexed by the end positions of their `key_len`-grams."""

    key_len: int
    max_docs: int
    docs: deque[list[int]] = field(default_factory=deque)
    ends: dict[tuple[int, ...], list[tuple[list[int], int]]] = field(default_factory=dict)

    def add(self, doc: list[int]) -> None:
        n = self.key_len
        if self.max_docs == 0 or len(doc) <= n:
            return
        if len(self.docs) >= self.max_docs:
            self._drop(self.docs.popleft())
        self.docs.append(doc)
        for p in range(n - 1, len(doc) - 1):  # a match at the last token has nothing after it
            add_end(self.ends, tuple(doc[p - n + 1 : p + 1]), (doc, p))

    def _drop(self, doc: list[int]) -> None:
        n = self.key_len
        for p in range(n - 1, len(doc) - 1):
            key = tuple(doc[p - n + 1 : p + 1])
            found = self.ends.get(key)
            if found is None:
                continue
            kept = [e for e in found if e[0] is not doc]
            if kept:
                self.ends[key] = kept
            else:
                del self.ends[key]

    def lookup(self, ctx: Sequence[int], max_len: int, num_tokens: int) -> Match | None:
        """The longest match of ctx's suffix in the documents, and what followed it there."""
        n = self.key_len
        if len(ctx) < n:
            return None
        found = self.ends.get(tuple(ctx[len(ctx) - n :]))
        if not found:
            return None
        length, doc, end = longest_match(reversed(found[-MAX_CANDIDATES:]), ctx, max_len)
        return Match(length, list(doc[end + 1 : end + 1 + num_tokens]))


@dataclass(slots=True)
class SuffixCache:
    """Every tenant's corpus of earlier outputs."""

    key_len: int
    max_len: int
    max_docs: int
    tenants: dict[bytes, Corpus] = field(default_factory=dict)

    def add(self, tenant: bytes, token_ids: list[int], num_prompt_tokens: int) -> None:
        """A finished sample's output (with the prompt's tail before it) joins its tenant's."""
        if len(token_ids) <= num_prompt_tokens:
            return
        corpus = self.tenants.get(tenant)
        if corpus is None:
            corpus = self.tenants[tenant] = Corpus(self.key_len, self.max_docs)
        start = max(0, num_prompt_tokens - self.key_len - self.max_len)
        corpus.add(token_ids[start:])

    def lookup(self, tenant: bytes, ctx: Sequence[int], num_tokens: int) -> Match | None:
        corpus = self.tenants.get(tenant)
        return None if corpus is None else corpus.lookup(ctx, self.max_len, num_tokens)
