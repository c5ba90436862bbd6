"""A tiny random checkpoint written as a GGUF file, as llama.cpp's converter lays one out.

`write_gguf(folder, file, types)` takes a folder from tiny_models (Llama or Qwen2 layout) and
writes its config, tokenizer and weights into one GGUF file with the `gguf` package's own writer:
2D weights quantized by `gguf.quants.quantize` into the type `types` gives them (by a substring
of their transformers name; others F32), norms and biases F32, a Llama's q / k rows permuted as
llama.cpp's converter permutes them. transformers' GGUF loader (`gguf_file=`) reads the file
back as the dequantized model: the reference the parity tests compare with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """transformers' tensor name -> llama.cpp's (the families of tiny_models' Llama / Qwen2)."""
    module, _, suffix = hf_name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{suffix}"
    _, _, rest = module.partition("model.layers.")
    layer, _, part = rest.partition(".")
    return f"blk.{layer}.{_LAYER[part]}.{suffix}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q / k row permutation (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(folder: str | Path, file: str | Path, types: Mapping[str, str]) -> Path:
    """Writes `folder`'s model into `file`; `types`: a substring of a 2D weight's transformers
    name (e.g. "q_proj", "embed_tokens") -> a GGUF type name ("Q4_0", "Q4_1", "Q8_0", "F16", ...);
    the first that matches wins, F32 where none does."""
    import gguf
    from safetensors.numpy import load_file

    src, out = Path(folder), Path(file)
    cfg = json.loads((src / "config.json").read_text())
    arch = {"llama": "llama", "qwen2": "qwen2"}[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(src.name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    _add_tokenizer(writer, src, cfg)
    for name, tensor in sorted(load_file(str(src / "model.safetensors")).items()):
        w = tensor.astype(np.float32)
        if arch == "llama" and name.endswith(".weight") and ".q_proj." in name:
            w = _permute(w, heads)
        if arch == "llama" and name.endswith(".weight") and ".k_proj." in name:
            w = _permute(w, kv_heads)
        kind = next((t for key, t in types.items() if key in name), "F32") if w.ndim == 2 else "F32"
        qtype = gguf.GGMLQuantizationType[kind]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), w)
        else:
            raw = quantized_blocks(w, qtype, np.random.default_rng(len(name)))
            writer.add_tensor(gguf_name(name), raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantized_blocks(w: np.ndarray, qtype: object, rng: np.random.Generator) -> np.ndarray:
    """w in `qtype`'s blocks: gguf's own quantizer where it has one; a type it can only
    dequantize (Q4_K, Q6_K) gets random blocks of w's magnitude instead (the tensor's values are
    then whatever the file says: transformers reads the same file)."""
    import gguf

    assert isinstance(qtype, gguf.GGMLQuantizationType)
    n, k = w.shape
    if qtype == gguf.GGMLQuantizationType.Q6_K:  # d sc (q - 32): |sc| and |q - 32| average 32, 16
        blocks = rng.integers(0, 256, size=(n * k // 256, 210), dtype=np.uint8)
        d = float(np.abs(w).mean()) / 512
        blocks[:, 208:210] = np.full((len(blocks), 1), d, dtype=np.float16).view(np.uint8)
        return blocks.reshape(n, k // 256 * 210)
    if qtype != gguf.GGMLQuantizationType.Q4_K:
        return np.asarray(gguf.quants.quantize(w, qtype))
    blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    d = float(np.abs(w).mean()) / 240  # d sc q - dmin m: sc, m and q average 31, 31 and 7.5
    blocks[:, 0:2] = np.full((len(blocks), 1), d, dtype=np.float16).view(np.uint8)
    blocks[:, 2:4] = np.full((len(blocks), 1), 7.5 * d, dtype=np.float16).view(np.uint8)
    return blocks.reshape(n, k // 256 * 144)


def _add_tokenizer(writer: object, src: Path, cfg: dict[str, object]) -> None:
    """The folder's byte-level BPE as llama.cpp stores a GPT-2 style tokenizer."""
    import gguf

    assert isinstance(writer, gguf.GGUFWriter)
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    size = int(cfg["vocab_size"])  # type: ignore[call-overload]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), size)]
    special = {a["id"] for a in tok["added_tokens"]}
    types = [
        gguf.TokenType.CONTROL if i in special or i >= len(vocab) else gguf.TokenType.NORMAL
        for i in range(size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(int(cfg["bos_token_id"]))  # type: ignore[call-overload]
    writer.add_eos_token_id(int(cfg["eos_token_id"]))  # type: ignore[call-overload]
    writer.add_add_bos_token(False)
    template = src / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())
