"""The GGUF reader (engine/worker/gguf_file.py) against the `gguf` package's own reader, and the
config and tokenizer made from it against transformers' GGUF loading (AutoConfig and
AutoTokenizer with `gguf_file=`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.testing.tiny_gguf import write_gguf
from engine.worker.gguf_checkpoint import load_tokenizer, read_config
from engine.worker.gguf_file import read_gguf

TYPES = {"q_proj": "Q4_0", "gate_proj": "Q8_0", "down_proj": "Q5_0", "proj": "Q4_1"}
TEXTS = ("Hello there, what is the capital of France?\n\n  ok", "  x\ty 123 éà 日本 <|im_end|>", "")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = request.getfixturevalue(f"tiny_{request.param}_path")
    out = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    return write_gguf(folder, out, TYPES)


def test_tensors_and_metadata_are_the_gguf_readers(gguf_file: Path) -> None:
    from gguf import GGUFReader

    theirs = GGUFReader(gguf_file)
    ours = read_gguf(gguf_file, string_arrays=("tokenizer.ggml.tokens",))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    kinds = {t.kind.name for t in ours.tensors}
    assert {"Q4_0", "Q8_0", "Q5_0", "Q4_1", "F32"} <= kinds, kinds
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.kind, a.dims, a.nbytes) == (b.tensor_type, tuple(b.shape.tolist()), b.n_bytes)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        want = theirs.fields[key].contents()
        got = ours.metadata[key]
        if key == "tokenizer.ggml.merges":  # a string array not asked for: its length
            assert got == len(want)
        elif isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want, key


def test_config_and_tokenizer_are_transformers(gguf_file: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    ours = read_config(gguf_file)
    theirs = AutoConfig.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, local_files_only=True
    )
    assert ours.architectures == [f"{ours.model_type.capitalize()}ForCausalLM"]
    theirs.architectures = ours.architectures  # (transformers' GGUF config names none)
    assert ours.to_dict() == theirs.to_dict()
    tok = load_tokenizer(gguf_file)
    ref = AutoTokenizer.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, local_files_only=True
    )
    assert type(tok) is type(ref)
    assert tok.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert tok.init_kwargs == ref.init_kwargs and tok.chat_template == ref.chat_template
    assert tok.special_tokens_map == ref.special_tokens_map
    for text in TEXTS:
        assert tok(text).input_ids == ref(text).input_ids


def test_cut_or_garbled_files_are_refused(gguf_file: Path, tmp_path: Path) -> None:
    data = gguf_file.read_bytes()
    cases = {
        "in the metadata": (data[:200], "cut short|past the end of the file"),
        "in the tensors": (data[: len(data) - 1], "runs past the end"),
        "version": (data[:4] + (7).to_bytes(4, "little") + data[8:], "version 7"),
    }
    for name, (raw, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(raw)
        with pytest.raises(ValueError, match=message):
            read_gguf(path)
