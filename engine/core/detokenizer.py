"""Incremental detokenization with stop strings.

Each step decodes only a small window of recent output tokens (vLLM/TGI's prefix_offset /
read_offset technique): `decode(ids[prefix:])` minus `decode(ids[prefix:read])` is the new text,
where `prefix..read` is the chunk that produced the last emitted text. The window's first token
decodes the same way in both calls, so SentencePiece's "strip the leading space of the first token"
cancels out and spaces come out as in one decode of the whole output. While the window's text ends
with U+FFFD (a character whose UTF-8 bytes are split over tokens) nothing is emitted.

The emitted text is `tokenizer.decode(output_ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False)` cut before the first stop string. NOTE: only the output ids
are decoded, so with a SentencePiece tokenizer the first output token's leading space is dropped,
as in `tokenizer.decode(output_ids)` (vLLM keeps it by decoding with the prompt as context).

Stop strings: the longest suffix of the text that is a prefix of some stop string is held back, so
a stop string spanning token boundaries is never partly emitted. The earliest match wins; it and
everything after it are left out. As in vLLM, stop strings are not checked before `min_tokens`
tokens exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.sample.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


def rust_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The Rust tokenizer behind a fast tokenizer whose `_decode` is transformers' own (so its
    decode is the Rust tokenizer's and nothing else), else None."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    return tokenizer.backend_tokenizer  # type: ignore[attr-defined]


def make_decode(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)` as a
    function of the ids.

    NOTE: for a fast (Rust) tokenizer whose `_decode` is transformers' own, that call is the Rust
    tokenizer's `decode(ids, skip_special_tokens)` and nothing else; calling it directly gives the
    same text in about a third of the time (two decodes per generated token add up at batch 256).
    """
    backend = rust_tokenizer(tokenizer)
    if backend is not None:

        def fast(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        return fast

    def slow(ids: list[int]) -> str:
        text = tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)
        return text

    return slow


def make_stream(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Any:
    """A `tokenizers` DecodeStream and the Rust tokenizer it steps with, for a fast tokenizer with a
    byte-level decoder (GPT-2 style: Llama 3, Qwen, SmolLM2), else None: the same
    prefix/read-offset window, kept in Rust, one call a token.

    NOTE: only byte-level: with SentencePiece byte fallback the stream can emit a chunk that is
    not a prefix of the whole decode (ids of two lone bytes gave "\\x00\\ufffd" where the decode
    is "\\ufffd\\ufffd"), which the windowed path never does.

    NOTE: vLLM's fast incremental detokenizer uses it too; here it replaces two Python-driven
    decodes a token (~1 us a token instead of ~3-5, which counts at batch 256)."""
    try:
        from tokenizers.decoders import ByteLevel, DecodeStream
    except ImportError:
        return None
    backend = rust_tokenizer(tokenizer)
    if backend is None or not isinstance(backend.decoder, ByteLevel):
        return None
    return DecodeStream(skip_special_tokens=skip_special_tokens), backend


class IncrementalDetokenizer:
    """Turns one sample's output tokens into text deltas; one instance per sample."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        """`prompt_token_ids` are not decoded (see the module docstring)."""
        self.tokenizer = tokenizer
        self.params = params
        self._decode = make_decode(tokenizer, params.skip_special_tokens)
        self._chunks: list[str] = []
        """The text emitted so far, in the pieces it was emitted in (`text` joins them)."""
        self.stop_string: str | None = None
        """The stop string that matched, once one has; nothing more is emitted after it."""
        self._ids: list[int] = []
        # The decode window: ids[prefix_offset:read_offset] produced the last emitted text,
        # ids[read_offset:] have not produced emitted text yet.
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        """decode(ids[prefix_offset:read_offset])."""
        self._held = ""
        """Decoded text held back because it may be the start of a stop string."""
        self._stops = [s for s in params.stop if s]
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._finished = False
        self._stream = make_stream(tokenizer, params.skip_special_tokens)
        """(DecodeStream, Rust tokenizer) where available: it keeps the window itself."""
        self._stream_chars = 0
        """Characters of the output's text the stream has produced so far."""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text that is now safe to emit (may be "")."""
        if self._finished:
            return ""
        self._ids.append(token_id)
        if self._stream is not None:
            stream, backend = self._stream
            try:
                chunk = stream.step(backend, token_id)  # None while a character is incomplete
            except Exception:  # the stream's own errors ("invalid prefix encountered")
                self._leave_stream()
            else:
                if not chunk:
                    return ""
                self._stream_chars += len(chunk)
                return self._emit(chunk, final=False)
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_text = self._decode(self._ids[self._read_offset :])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._emit(delta, final=False)

    def _leave_stream(self) -> None:
        """Continues on the windowed path from where the stream stopped (not expected with a
        byte-level decoder): the window restarts at the first id, its text the stream's so far."""
        ids = self._ids[:-1]  # the ids before the token the stream refused
        self._prefix_offset, self._read_offset = 0, len(ids)
        self._prefix_text = self._decode(ids)[: self._stream_chars]
        self._stream = None

    def flush(self) -> str:
        """At finish (not by a stop string): returns the text still held back."""
        if self._finished:
            return ""
        if self._stream is not None:  # what the stream still holds: the rest of the whole decode
            delta = self._decode(self._ids)[self._stream_chars :]
        else:
            delta = self._decode(self._ids[self._prefix_offset :])[len(self._prefix_text) :]
        out = self._emit(delta, final=True)
        self._finished = True
        return out

    def _emit(self, delta: str, *, final: bool) -> str:
        """Adds decoded text; returns what may be emitted now."""
        if not self._stops:
            self._chunks.append(delta)
            return delta
        buf = self._held + delta
        if len(self._ids) >= self.params.min_tokens:
            match = self._find_stop(buf)
            if match is not None:
                start, stop = match
                out = buf[:start]
                self.stop_string = stop
                self._finished = True
                self._held = ""
                self._chunks.append(out)
                return out
        keep = 0 if final else self._partial_stop_len(buf)
        out = buf[: len(buf) - keep]
        self._held = buf[len(buf) - keep :]
        self._chunks.append(out)
        return out

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        """(start, stop string) of the earliest stop string in `buf` (list order breaks ties)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            i = buf.find(stop)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._max_stop_len - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
