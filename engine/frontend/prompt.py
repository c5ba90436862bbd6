"""A prompt's token ids and block-hash chain: the one rule, used by the engine and the router.

Text is tokenized with `encode(text, add_special_tokens=True)`; chat messages are rendered with
the tokenizer's chat template and the generation prompt; token ids are taken as given. A
prompt's full blocks hash as `engine.kv.hashing.hash_blocks` with the extra keys of
`prompt_hash_extra` (model identity and cache salt, an empty salt being no salt). The engine
(`engine/frontend/input_processor.py`), the replica agent and the router (`service/router/prompt.py`)
all call these functions, so a router finds exactly the blocks a replica caches.

Imports no torch: the router loads only a tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.kv.hashing import BlockHash, extra_keys, hash_blocks

Prompt = str | Sequence[int]


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def tokenize_prompt(
    tokenizer: Any, prompt: Prompt | None = None, messages: list[dict[str, str]] | None = None
) -> list[int]:
    """Token ids of text, of chat messages (chat template applied), or ids as given.

    Raises ValueError saying what to fix.
    """
    if messages is not None:
        if prompt is not None:
            raise ValueError("give either a prompt or chat messages, not both")
        if not messages:
            raise ValueError("chat messages are empty: give at least one message")
        return apply_chat_template(tokenizer, messages)
    if prompt is None:
        raise ValueError("the prompt is empty: give text, token ids or chat messages")
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    return [int(t) for t in prompt]


def prompt_hash_extra(model_id: str, cache_salt: str | None) -> bytes:
    """The extra keys a request's blocks hash with; an empty salt is no salt (proto3's "")."""
    return extra_keys(model_id, cache_salt or None)


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, model_id: str, cache_salt: str | None
) -> list[BlockHash]:
    """Hashes of the prompt's full blocks, exactly as the engine computes them."""
    return hash_blocks(token_ids, block_size, prompt_hash_extra(model_id, cache_salt))
