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
        assert a.offset == b.data_offset, a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        want = theirs.fields[key].contents()
        got = ours.metadata[key]
        if key == "tokenizer.ggml.merges":  # a string array not asked for: its length
            assert got == len(want)
        else:
            assert got == want and type(got) is type(want), key


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


def test_a_config_without_vocab_size_counts_the_tokens(tmp_path: Path) -> None:
    """A file whose metadata has no `{arch}.vocab_size` (many Qwen2 files): the vocabulary's
    length, as transformers counts it."""
    import gguf
    from transformers import AutoConfig

    path = tmp_path / "qwen2.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_token_list([f"t{i}" for i in range(40)])
    writer.add_tensor("token_embd.weight", np.zeros((40, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = read_config(path)
    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name, local_files_only=True)
    theirs.architectures = ours.architectures
    assert ours.vocab_size == 40 and ours.to_dict() == theirs.to_dict()


def test_cut_or_garbled_files_are_refused(gguf_file: Path, tmp_path: Path) -> None:
    data = gguf_file.read_bytes()
    end = max(t.offset + t.nbytes for t in read_gguf(gguf_file).tensors)  # (the last tensor's)
    cases = {
        "in the metadata": (data[:200], "cut short|past the end of the file"),
        "in the tensors": (data[: end - 1], "runs past the end"),
        "version": (data[:4] + (7).to_bytes(4, "little") + data[8:], "version 7"),
        "byte order": (data[:4] + (3).to_bytes(4, "big") + data[8:], "big-endian"),
    }
    for name, (raw, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(raw)
        with pytest.raises(ValueError, match=message):
            read_gguf(path)
