"""Chat prompts tokenized from cached pieces (service/router/chat_tokens.py) give the engine's ids."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine.frontend.prompt import tokenize_prompt
from service.router.chat_tokens import ChatTokenizer
from service.router.prompt import load_router_tokenizer

_WORDS = ["alpha", "beta", " gamma", "Δelta", "12", "3.5", "\n", "  ", "\t", "ok!", "🙂", "x y"]


def _message(rng: random.Random) -> str:
    return "".join(
        rng.choice(_WORDS) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(0, 40))
    )


def _conversations(seed: int, n: int = 6, turns: int = 5) -> list[list[dict[str, str]]]:
    """Every turn's messages of `n` conversations that share a system prompt."""
    rng = random.Random(seed)
    system = {"role": "system", "content": _message(rng)}
    out = []
    for _ in range(n):
        history = [system]
        for _ in range(turns):
            history = [*history, {"role": "user", "content": _message(rng)}]
            out.append(history)
            history = [*history, {"role": "assistant", "content": _message(rng)}]
    return out


def _check(tok: Any) -> ChatTokenizer:
    chat = ChatTokenizer(tok)
    assert chat.enabled
    for messages in _conversations(0):
        assert chat.ids(messages) == tokenize_prompt(tok, messages=messages)
    return chat


def test_tiny_tokenizer_pieces_match_the_engine(tiny_llama_path: Path) -> None:
    tok = load_router_tokenizer(str(tiny_llama_path), "/nonexistent")
    chat = _check(tok)
    # A new turn tokenizes only its new message: one new piece per message.
    before = chat.cached_pieces
    turn = [{"role": "user", "content": "a brand new question"}]
    chat.ids([*_conversations(0)[-1], *turn])
    assert chat.cached_pieces == before + 1


def test_demo_tokenizer_pieces_match_the_engine() -> None:
    folder = Path.home() / ".cache" / "deja" / "smollm2-135m-instruct"
    if not (folder / "tokenizer.json").exists():
        pytest.skip("the demo model is not installed")
    _check(load_router_tokenizer(str(folder), "/nonexistent"))


def test_a_tokenizer_that_breaks_the_rule_is_tokenized_whole(tiny_llama_path: Path) -> None:
    tok: Any = load_router_tokenizer(str(tiny_llama_path), "/nonexistent")

    class PrefixSpace:  # encodes each piece as if it had a leading space (SentencePiece-like)
        def __getattr__(self, name: str) -> Any:
            return getattr(tok, name)

        def __call__(self, text: Any, **kw: Any) -> Any:
            if isinstance(text, list):
                return tok([" " + t for t in text], **kw)
            return tok(text, **kw)

    odd = PrefixSpace()
    chat = ChatTokenizer(odd)
    assert not chat.enabled
    messages = _conversations(1)[-1]
    assert chat.ids(messages) == tokenize_prompt(odd, messages=messages)
    assert chat.cached_pieces == 0
