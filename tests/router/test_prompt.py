"""The router hashes a prompt exactly as the replica's engine does (tokens, template, salt)."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.kv.hashing import extra_keys, hash_blocks
from engine.llm_engine import LLMEngine
from service.proto.deja.v1 import inference_pb2 as pb
from service.router_prompt import PromptHasher, load_router_tokenizer
from service.server import derive_cache_salt

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def test_token_ids_and_chain_match_the_engine(tiny_llama_path: Path) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_llama_path), num_device_blocks=64))
    hasher = PromptHasher(load_router_tokenizer(str(tiny_llama_path), "/nonexistent"))
    text = "The quick brown fox jumps over the lazy dog. " * 8

    req = pb.GenerateRequest(text=text)
    assert hasher.token_ids(req) == engine.tokenize(text)
    chat = pb.GenerateRequest()
    chat.chat.messages.extend(pb.ChatMessage(**m) for m in MESSAGES)
    ids = hasher.token_ids(chat)
    assert ids is not None and ids == engine.tokenize(messages=MESSAGES)
    assert hasher.token_ids(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]))) == [5, 6]

    info = engine.model_info
    chain = hasher.chain(ids, info.model_id, info.block_size, "salt")
    assert chain == hash_blocks(ids, info.block_size, extra_keys(info.model_id, "salt"))
    assert len(chain) == len(ids) // info.block_size


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
