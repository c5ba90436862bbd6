"""The router's view of a request: engine/frontend/prompt.py on the proto's input, the replica's salt."""

from __future__ import annotations

from pathlib import Path

from engine.frontend.prompt import prompt_block_hashes, tokenize_prompt
from service.api.deja.v1 import inference_pb2 as pb
from service.common.auth import derive_cache_salt
from service.router.prompt import PromptHasher, load_router_tokenizer

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def test_each_input_kind_goes_through_the_engine_rule(tiny_llama_path: Path) -> None:
    tok = load_router_tokenizer(str(tiny_llama_path), "/nonexistent")
    hasher = PromptHasher(tok)
    text = "The quick brown fox jumps over the lazy dog. " * 8

    assert hasher.token_ids(pb.GenerateRequest(text=text)) == tokenize_prompt(tok, text)
    chat = pb.GenerateRequest()
    chat.chat.messages.extend(pb.ChatMessage(**m) for m in MESSAGES)
    ids = hasher.token_ids(chat)
    assert ids is not None and ids == tokenize_prompt(tok, messages=MESSAGES)
    assert hasher.token_ids(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]))) == [5, 6]
    assert hasher.token_ids(pb.GenerateRequest(chat=pb.ChatMessages())) is None  # bad input
    assert hasher.chain(ids, "m", 4, "salt") == prompt_block_hashes(ids, 4, "m", "salt")


def test_without_tokenizer_only_token_ids_are_known() -> None:
    hasher = PromptHasher(None)
    assert hasher.token_ids(pb.GenerateRequest(text="hello")) is None
    assert hasher.token_ids(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]))) == [1]


def test_cache_salt_follows_the_replicas_auth_rules() -> None:
    req = pb.GenerateRequest(text="x", cache_salt="mine")
    assert PromptHasher(None).cache_salt(req, []) == "mine"
    assert PromptHasher(None).cache_salt(pb.GenerateRequest(text="x"), []) is None

    tokens = [("tok-a", "acme"), ("tok-b", "globex")]
    md = [("authorization", "Bearer tok-a")]
    assert PromptHasher(None, tokens).cache_salt(req, md) == derive_cache_salt(
        "acme", "mine", False
    )
    allow = PromptHasher(None, tokens, allow_client_cache_salt=True)
    assert allow.cache_salt(req, md) == derive_cache_salt("acme", "mine", True)
    assert PromptHasher(None, tokens).cache_salt(req, [("authorization", "Bearer nope")]) is None
