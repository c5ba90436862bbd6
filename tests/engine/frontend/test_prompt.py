"""engine/frontend/prompt.py: the one rule for a prompt's token ids and hash chain (engine and router)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.frontend.prompt import prompt_block_hashes, prompt_hash_extra, tokenize_prompt
from engine.kv.hashing import extra_keys, hash_blocks
from engine.worker.model_loader import load_tokenizer

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_tokenize_text_chat_and_ids(tiny_llama_path: Path) -> None:
    tok = load_tokenizer(tiny_llama_path)
    text = "The quick brown fox jumps over the lazy dog."
    assert tokenize_prompt(tok, text) == list(tok.encode(text, add_special_tokens=True))
    chat = tokenize_prompt(tok, messages=MESSAGES)
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tok.decode(chat) == tok.decode(tok.encode(rendered, add_special_tokens=False))
    assert tokenize_prompt(None, [5, 6]) == [5, 6]
    with pytest.raises(ValueError, match="not both"):
        tokenize_prompt(tok, "x", messages=MESSAGES)
    with pytest.raises(ValueError, match="chat messages are empty"):
        tokenize_prompt(tok, messages=[])
    with pytest.raises(ValueError, match="the prompt is empty"):
        tokenize_prompt(tok)


def test_prompt_chain_is_the_hash_chain_with_model_and_salt() -> None:
    ids = list(range(70))
    chain = prompt_block_hashes(ids, 16, "m", "salt")
    assert chain == hash_blocks(ids, 16, extra_keys("m", "salt"))
    assert len(chain) == 4  # the partial tail is not hashed
    # An empty salt is no salt (proto3 strings default to "").
    assert prompt_hash_extra("m", "") == prompt_hash_extra("m", None) == extra_keys("m")
    assert prompt_block_hashes(ids, 16, "m", "x") != prompt_block_hashes(ids, 16, "m", None)
    assert prompt_block_hashes(ids, 16, "other", None) != prompt_block_hashes(ids, 16, "m", None)
