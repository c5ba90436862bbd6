"""The bounded subset of a prompt's block-hash chain that the affinity store records."""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv.hashing import BlockHash


def bounded_chain(block_hashes: Sequence[BlockHash], limit: int) -> list[BlockHash]:
    """At most `limit` hashes of a chain: all of them, or the first `limit - 1` and the last.

    Hashes are chained, so the last hash alone stands for the whole prompt and the leading ones
    for the shared prefixes (system prompts) other sessions are likely to reuse.
    """
    if len(block_hashes) <= limit:
        return list(block_hashes)
    if limit == 1:
        return [block_hashes[-1]]
    return [*block_hashes[: limit - 1], block_hashes[-1]]
