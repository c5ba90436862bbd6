"""GGUF files as a model source: the config, tokenizer and weights of a llama.cpp checkpoint.

`--model FILE.gguf` (or a folder holding one .gguf file and no config.json) is served from the
file itself. deja reads its metadata and tensor table (gguf_file.py) and makes the config with
transformers' GGUF tables; transformers' converter makes the tokenizer. Each tensor is
dequantized to float32 and loaded like a safetensors weight, and the quantized 2D ones are also
kept in their blocks (`QuantizedRows`), from which the loader makes Q4_0 / Q4_1 linears and the
embedding quantized layers (layers/quantized.py) on the CPU.

llama.cpp's converter permutes the rows of a Llama q / k projection (its RoPE pairs neighbouring
elements, transformers' pairs the halves); they are permuted back here, rows of blocks alike:
a row permutation moves whole rows, so quantized blocks stay exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.worker.gguf_file import GGUFFile, read_gguf

SUFFIX = ".gguf"

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""GGUF `general.architecture` values deja serves (llama covers Llama, SmolLM and Mistral) ->
the transformers architecture the config gets (GGUF metadata names none)."""

PERMUTED_ARCHITECTURES = ("llama",)
"""Architectures whose q / k rows llama.cpp's converter permuted (transformers undoes the same)."""

_LAYER_NAMES = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
"""transformers' module names in a decoder layer of the families above."""


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf file in a folder that has no
    config.json; None for a Hugging Face folder. Raises ValueError for a folder with several."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == SUFFIX:
        return p
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    files = sorted(p.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ValueError(
            f"model folder {str(p)!r} holds {len(files)} GGUF files ({names}); pass one"
        )
    return files[0] if files else None


@dataclass(frozen=True, slots=True)
class QuantizedRows:
    """A [N, K] weight kept in its GGUF blocks: `blocks` is uint8 [N, bytes a row] (rows as
    transformers orders them)."""

    kind: Any
    """The gguf.GGMLQuantizationType."""
    blocks: np.ndarray
    shape: tuple[int, int]


def read_config(file: Path) -> Any:
    """The file's metadata as a transformers config: the dict transformers' GGUF loader
    (`load_gguf_checkpoint`) makes for the families in ARCHITECTURES, with its own tables, from
    the metadata read by `read_gguf` (the loader's gguf.GGUFReader parses every vocabulary
    string: seconds)."""
    from transformers import CONFIG_MAPPING
    from transformers.integrations import ggml

    gguf = open_gguf(file)
    meta = gguf.metadata
    arch = _architecture(meta, file)
    # (transformers tests `"mistral" in [general.name]`: a name of exactly "mistral")
    model_type = "mistral" if arch == "llama" and meta.get("general.name") == "mistral" else arch
    defaults: dict[str, Any] = ggml.GGUF_CONFIG_DEFAULTS_MAPPING
    mapping: dict[str, Any] = ggml.GGUF_CONFIG_MAPPING
    config: dict[str, Any] = {
        **defaults.get(model_type, defaults.get(arch) or {}),
        "tie_word_embeddings": "output.weight" not in gguf.tensor_names,
    }
    for key, value in meta.items():
        prefix, _, rest = key.replace(arch, model_type).partition(".")
        renames = mapping.get(prefix, {})
        if rest not in renames or renames[rest] in (None, -1):
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        config[renames[rest]] = value.replace(arch, model_type) if isinstance(value, str) else value
    tokens = meta.get("tokenizer.ggml.tokens")  # (a count: read_gguf steps over its strings)
    if "vocab_size" not in config and tokens is not None:
        config["vocab_size"] = tokens
    hf_config = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    hf_config._name_or_path = str(file.parent)  # (as from_pretrained sets it)
    hf_config.architectures = [ARCHITECTURES[arch]]
    return hf_config


def load_tokenizer(file: Path) -> Any:
    """The tokenizer and chat template stored in the file (transformers' GGUF converter), in the
    class AutoTokenizer picks for a GGUF file's config when its folder says nothing more (no
    tokenizer_config.json), without AutoTokenizer's own rebuild of that config (transformers'
    slow reader for these families); elsewhere AutoTokenizer itself."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    where: dict[str, Any] = {"gguf_file": file.name, "local_files_only": True}
    cls: Any = TOKENIZER_MAPPING.get(type(read_config(file)), TokenizersBackend)
    if cls.__name__ == "MistralCommonBackend" or (file.parent / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(file.parent), **where)
    return cls.from_pretrained(str(file.parent), **where)


def open_gguf(file: Path) -> GGUFFile:
    """`read_gguf(file)`; a file that is not a whole GGUF file (wrong magic, truncated, an
    unknown tensor type) raises ValueError naming it."""
    try:
        return read_gguf(file)
    except (ValueError, OSError) as e:
        raise ValueError(f"{str(file)!r} is not a readable GGUF file: {e}") from e


def _architecture(metadata: dict[str, Any], file: Path) -> str:
    """The file's `general.architecture`; ValueError where deja does not serve it."""
    arch = metadata.get("general.architecture", "(none)")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {file.name} is not served; deja serves "
            + ", ".join(ARCHITECTURES)
        )
    return str(arch)


def hf_names(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> transformers' name, for the families in ARCHITECTURES."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    name_map = get_tensor_name_map(arch_id, num_layers)
    modules = ["model.embed_tokens", "model.norm", "lm_head"]
    modules += [f"model.layers.{i}.{n}" for i in range(num_layers) for n in _LAYER_NAMES]
    out: dict[str, str] = {}
    for module in modules:
        gguf_name = name_map.get_name(module)
        if gguf_name is not None:
            for suffix in (".weight", ".bias"):
                out[gguf_name + suffix] = module + suffix
    return out


def _unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q / k permutation (transformers'
    `_reverse_permute_weights`): new row i is old row perm[i]."""
    half = num_rows // num_heads // 2
    return np.arange(num_rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(-1)


class GGUFCheckpoint:
    """One GGUF file's tensors under transformers' names; see the module docstring."""

    def __init__(self, file: Path, hf_config: Any) -> None:
        self.file = file
        self.gguf = open_gguf(file)
        self.arch = _architecture(self.gguf.metadata, file)
        self.config = hf_config
        self.quantized: dict[str, QuantizedRows] = {}
        """transformers name -> its blocks, for the tensors kept quantized (filled by weights())."""
        self.types: dict[str, str] = {}
        """transformers name -> its GGUF type name (filled by weights())."""

    def _row_order(self, hf_name: str) -> np.ndarray | None:
        if self.arch not in PERMUTED_ARCHITECTURES or not hf_name.endswith(".weight"):
            return None
        heads = int(self.config.num_attention_heads)
        kv_heads = int(getattr(self.config, "num_key_value_heads", None) or heads)
        if ".self_attn.q_proj." in hf_name:
            return _unpermute_rows(heads * self._head_dim(), heads)
        if ".self_attn.k_proj." in hf_name:
            return _unpermute_rows(kv_heads * self._head_dim(), kv_heads)
        return None

    def _head_dim(self) -> int:
        return int(
            getattr(self.config, "head_dim", None)
            or self.config.hidden_size // self.config.num_attention_heads
        )

    def weights(self, keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """(transformers name, float32 tensor) for every tensor in the file. With
        `keep_quantized`, the 2D tensors of a quantized type are also kept in their blocks in
        `self.quantized` (the float32 copy is still yielded: the loader checks names and shapes
        through it). Raises ValueError on a tensor that is not one of the model's."""
        from gguf import GGMLQuantizationType as T
        from gguf import quants

        names = hf_names(self.arch, int(self.config.num_hidden_layers))
        floats = (T.F32, T.F16, T.BF16)
        for t in self.gguf.tensors:
            name = names.get(t.name)
            if name is None:
                raise ValueError(
                    f"GGUF tensor {t.name!r} of {self.file.name} has no place in the model"
                )
            self.types[name] = t.kind.name
            data = np.asarray(t.data)
            order = self._row_order(name)
            if order is not None:
                data = data[order]
            if keep_quantized and t.kind not in floats and data.ndim == 2:
                shape = (int(data.shape[0]), int(t.dims[0]))  # GGUF shapes are innermost first
                self.quantized[name] = QuantizedRows(t.kind, np.ascontiguousarray(data), shape)
            try:
                values = quants.dequantize(data, t.kind)
            except NotImplementedError as e:
                raise ValueError(
                    f"GGUF tensor {t.name!r} has type {t.kind.name}, which gguf cannot "
                    "dequantize; deja serves F32, F16, BF16 and the types gguf dequantizes "
                    "(Q4_0, Q4_1, Q5_x, Q8_0, the K-quants, ...)"
                ) from e
            yield name, torch.from_numpy(np.array(values, dtype=np.float32))

    def tensor_bytes(self) -> int:
        """The bytes of every tensor in the file (what llama.cpp reads)."""
        return sum(t.nbytes for t in self.gguf.tensors)
