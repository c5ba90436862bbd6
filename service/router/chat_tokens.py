"""Chat prompts tokenized a piece at a time, the pieces' ids cached (the
router's own cost per request at 8k-token histories).

A chat prompt's ids are the chat template's text tokenized whole, without added special tokens
(engine/frontend/prompt.py). A fast tokenizer first splits that text at its added tokens
(`<|im_start|>`, `<|im_end|>`, ...) and encodes the pieces between them independently, so the
prompt's ids are the pieces' ids in order. Turn t of a conversation repeats turns 1..t-1 verbatim
and conversations share system prompts: all pieces but the newest message's are cached, and only
the template's rendering and the new message cost time.

The split rule holds for byte-level BPE tokenizers (SmolLM2's, Llama 3's, Qwen2's), not for every
tokenizer: a SentencePiece one adds a prefix space to each piece, an added token with `lstrip`
takes the space before it. `ChatTokenizer.enabled` is therefore decided at construction on a
probe conversation compared with the engine's tokenization; when it is off, `ids()` is the
engine's own function.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

from engine.frontend.prompt import tokenize_prompt

_PROBE = [
    {"role": "system", "content": "You are terse.\n\n  Indented, trailing space "},
    {"role": "user", "content": " leading space, digits 12345, ünïcödé, emoji 🙂\tTab"},
    {"role": "assistant", "content": "\n"},
    {"role": "user", "content": "x" * 37 + " y  z\n\n"},
]
"""Spaces, newlines and bytes at piece edges: where a per-piece tokenization would differ."""


class ChatTokenizer:
    """`ids(messages)`: the engine's token ids of a chat prompt, from cached pieces when the
    tokenizer allows (thread-safe: the router tokenizes in worker threads)."""

    def __init__(self, tokenizer: Any, max_pieces: int = 16384) -> None:
        self._tok = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._special = {t.content: int(i) for i, t in added.items()}
        self._split = re.compile(
            "(" + "|".join(re.escape(s) for s in sorted(self._special, key=len, reverse=True)) + ")"
        )
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._max_pieces = max_pieces
        self._lock = threading.Lock()
        plain = all(not (t.lstrip or t.rstrip) for t in added.values())
        self.enabled = bool(self._special) and plain and self._agrees(_PROBE)
        self._cache.clear()

    @property
    def cached_pieces(self) -> int:
        return len(self._cache)

    def ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids the engine computes for `messages` (chat template, generation prompt);
        ValueError as the engine's for bad input."""
        if not self.enabled or not messages:
            return tokenize_prompt(self._tok, messages=messages)
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """`text` (template output) tokenized without added special tokens, piece by piece."""
        parts = self._split.split(text)  # text, special, text, special, ..., text
        with self._lock:
            missing = [p for p in dict.fromkeys(parts[0::2]) if p and p not in self._cache]
        if missing:
            encoded = self._tok(missing, add_special_tokens=False)["input_ids"]
            with self._lock:
                for piece, ids in zip(missing, encoded, strict=True):
                    self._cache[piece] = list(ids)
        out: list[int] = []
        with self._lock:
            for i, part in enumerate(parts):
                if i % 2:
                    out.append(self._special[part])
                elif part:
                    ids = self._cache.get(part)
                    if ids is None:  # evicted meanwhile by another thread
                        ids = list(self._tok(part, add_special_tokens=False)["input_ids"])
                    else:
                        self._cache.move_to_end(part)
                    out.extend(ids)
            while len(self._cache) > self._max_pieces:
                self._cache.popitem(last=False)
        return out

    def _agrees(self, messages: list[dict[str, str]]) -> bool:
        """Whether piecewise tokenization gives the engine's ids on `messages`."""
        try:
            text = self._tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            return self.encode(text) == tokenize_prompt(self._tok, messages=messages)
        except Exception:  # no chat template, or a tokenizer without this API: whole text
            return False
