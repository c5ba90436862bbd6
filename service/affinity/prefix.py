"""A prompt's block-hash chain as the engine computes it, and the bounded subset to record."""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv.hashing import BlockHash, extra_keys, hash_blocks


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, model_id: str, cache_salt: str | None
) -> list[BlockHash]:
    """Hashes of the prompt's full blocks, exactly the engine's (`engine.kv.hashing`)."""
    salt = cache_salt or None
    return hash_blocks(token_ids, block_size, extra_keys(model_id, salt))


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
