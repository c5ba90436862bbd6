"""Loads a local checkpoint: a Hugging Face folder (config, safetensors weights, tokenizer; AWQ and
GPTQ int4 folders through int4_checkpoint.py) or a GGUF file (gguf_checkpoint.py: the same three
read from the file).

Nothing is downloaded: every transformers call uses `local_files_only=True`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import ModelConfig
from engine.kv_io.host_memory import HostMemoryTrimmer
from engine.worker.attention.base import AttentionBackend
from engine.worker.attention.cpu_kernel import load_kernel
from engine.worker.attention.kv_quant import is_kv_scale_name
from engine.worker.gguf_checkpoint import GGUFCheckpoint, find_gguf
from engine.worker.gguf_checkpoint import load_tokenizer as gguf_tokenizer
from engine.worker.gguf_checkpoint import read_config as gguf_config
from engine.worker.int4_checkpoint import Int4Checkpoint, Int4Format, read_format
from engine.worker.models import get_model_class
from engine.worker.models.base import CausalLM
from engine.worker.models.layers.group_rows import gguf_int4
from engine.worker.models.layers.load_quant import quantize_loaded
from engine.worker.models.layers.quantized import (
    INT8_ROUNDING,
    quantize_embedding,
    quantize_linears,
)
from engine.worker.models.layers.weights import TPSlice, slice_map
from engine.worker.safetensors_reader import SafetensorsReader

if TYPE_CHECKING:
    from engine.worker.parallel.group import TPGroup

HFConfig = Any
"""A transformers PretrainedConfig (typed loosely: its attributes depend on the family)."""

log = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def _check_folder(path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise FileNotFoundError(f"model path {str(folder)!r} is not a folder")
    return folder


def read_hf_config(path: str | Path) -> HFConfig:
    """The checkpoint's config.json (a GGUF file's metadata) as a transformers config object."""
    from transformers import AutoConfig

    gguf = find_gguf(path)
    if gguf is not None:
        return gguf_config(gguf)
    folder = _check_folder(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(folder)!r} has no config.json")
    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint: the index's shards, model.safetensors, or all files
    (none for a GGUF file)."""
    if find_gguf(path) is not None:
        return []
    folder = _check_folder(path)
    index = folder / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists missing weight files: {missing}")
        return files
    if (folder / _SINGLE_FILE).is_file():
        return [folder / _SINGLE_FILE]
    # NOTE: Mistral-format "consolidated" files use other tensor names; skip them.
    files = [
        f for f in sorted(folder.glob("*.safetensors")) if not f.name.startswith("consolidated")
    ]
    if not files:
        raise FileNotFoundError(f"model folder {str(folder)!r} has no *.safetensors weights")
    return files


def model_fingerprint(
    model_path: str | Path, quantization: str = "auto", activations: str = "float"
) -> str:
    """blake2b over config.json and each weight file's name, size and first MiB (cheap, stable);
    over a GGUF file's name, size, first MiB (its metadata) and `quantization`
    (ModelConfig.quantization: kept and expanded weights write KV that differs in the last bits,
    so they do not share disk blocks); int8 `activations` mixed in too, for the same reason,
    with their rounding (INT8_ROUNDING: KV from another rounding is not shared either)."""
    if activations != "float":
        quantization = f"{quantization}:{activations}"
        if activations == "int8":
            quantization += f":{INT8_ROUNDING}"
    gguf = find_gguf(model_path)
    if gguf is not None:
        with open(gguf, "rb") as fh:
            head = fh.read(2**20)
        key = f"{gguf.name}:{gguf.stat().st_size}:{quantization}".encode()
        return hashlib.blake2b(key + head, digest_size=16).hexdigest()
    folder = _check_folder(model_path)
    h = hashlib.blake2b(digest_size=16)
    config = (folder / "config.json").read_bytes()
    h.update(config)
    if b'"quantization_config"' in config or quantization in LOAD_TIME:  # kept or expanded
        h.update(quantization.encode())
    for f in safetensors_files(folder):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(2**20))
    return h.hexdigest()


Slices = dict[str, TPSlice | None]
"""Tensor parallelism: a checkpoint name -> the (dim, start, length) part a rank reads, None for
none; names absent are read whole (layers/weights.py's slice_map)."""


def narrowed(
    weights: Iterable[tuple[str, torch.Tensor]], slices: Slices | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights` read whole (a GGUF file's, an AWQ / GPTQ folder's dequantized), each cut to this
    rank's part of it."""
    for name, tensor in weights:
        if slices is None or name not in slices:
            yield name, tensor
        elif (part := slices[name]) is not None:
            yield name, tensor.narrow(*part)


def iter_weights(
    path: str | Path, slices: Slices | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight of every weight file, read lazily on the CPU; KV-cache
    scales (`layers.N.self_attn.k_scale`, ...) are not weights: kv_calibration.py reads them.

    slices (tensor parallelism): name -> the (dim, start, length) part to read of it, None to
    skip it; names absent are read whole. Only those parts are read from the file (plain reads,
    no memory map: see safetensors_reader.py)."""
    for file in safetensors_files(path):
        with SafetensorsReader(file) as f:
            for name in f.names():
                if is_kv_scale_name(name):
                    continue
                if slices is None or name not in slices:
                    yield name, f.get(name)
                    continue
                part = slices[name]
                if part is not None:
                    yield name, f.get(name, part)


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    backend: AttentionBackend,
    tp: TPGroup | None = None,
) -> tuple[CausalLM, HFConfig]:
    """Builds our model for the folder's architecture, loads its weights in model_config.dtype on
    `device`, in eval mode with gradients off. With a tensor-parallel group: this rank's shard,
    read as slices of the checkpoint's tensors (no rank reads a whole split tensor). A GGUF file's
    4-bit linears stay 4-bit on the CPU (layers/quantized.py)."""
    hf_config = read_hf_config(model_config.path)
    model_cls = get_model_class(hf_config)
    gguf = find_gguf(model_config.path)
    int4 = None if gguf is not None else read_format(hf_config)
    keep_quantized = _keep_quantized(model_config, gguf, int4, device, backend.name)
    safetensors_files(model_config.path)  # fail on missing weights before building the model
    dtype: torch.dtype = getattr(torch, model_config.dtype)
    with torch.no_grad():
        model = model_cls(hf_config, dtype, backend, tp)
        slices = slice_map(model) if tp is not None else None
        if int4 is not None:
            checkpoint = Int4Checkpoint(int4, keep_quantized)
            kept = _load_int4(model, model_config.path, checkpoint, slices)
            model.weight_quantization = int4.method if kept else "none"
        elif gguf is None:
            model.load_weights(iter_weights(model_config.path, slices))
            if keep_quantized and _quantize_at_load(model, model_config.quantization):
                model.weight_quantization = model_config.quantization
        else:
            source = GGUFCheckpoint(gguf, hf_config)
            kept = _load_gguf(model, source, keep_quantized, device.type == "cpu", slices)
            model.weight_quantization = "gguf" if kept else "none"
        model = model.to(device)
        kernels = load_kernel().ops if device.type == "cpu" else None
        if model_config.activations == "int8":
            model.quantize_activations(kernels)
        if device.type == "cpu":
            model.use_cpu_layout(kernels)
        elif backend.name == "cupy":  # deja's CUDA kernels: the small per-layer ops, kept linears
            from cuda import layers, quant_linear

            model.use_kernels(layers, quant_linear)
    if tp is not None:  # the checkpoint slices read and the unpacked weights, back to the OS
        HostMemoryTrimmer(every_s=0.0).maybe_trim()
    model.eval()
    model.requires_grad_(False)
    return model, hf_config


LOAD_TIME = ("int4", "int8")
"""--quantization values that quantize a plain checkpoint's projections at load."""
_NEEDS = {
    "gguf": "a GGUF model (a .gguf file)",
    "awq": "an AWQ checkpoint (quant_method awq in config.json's quantization_config)",
    "gptq": "a GPTQ checkpoint (quant_method gptq in config.json's quantization_config)",
}


def _keep_quantized(
    model_config: ModelConfig,
    gguf: Path | None,
    int4: Int4Format | None,
    device: torch.device,
    backend: str,
) -> bool:
    """Whether a GGUF file's or an AWQ / GPTQ folder's quantized weights stay quantized
    (ModelConfig.quantization): on the CPU, and on CUDA with deja's kernels (the cupy attention
    backend, which brings cuda/quant_linear.py); ValueError where a format is asked for and
    cannot be."""
    kernels = device.type == "cpu" or (device.type == "cuda" and backend == "cupy")
    mode = model_config.quantization
    source = "gguf" if gguf is not None else int4.method if int4 is not None else None
    if mode in _NEEDS and mode != source:
        raise ValueError(f"quantization {mode} needs {_NEEDS[mode]}")
    if mode in LOAD_TIME and source is not None:
        raise ValueError(
            f"quantization {mode} quantizes a 16- or 32-bit checkpoint at load; this model is "
            f"{source.upper()} already: use quantization auto (kept) or none (expanded)"
        )
    if (mode in _NEEDS or mode in LOAD_TIME) and not kernels:
        raise ValueError(
            f"quantization {mode} runs on the CPU, or on CUDA with attention_backend cupy "
            f"(deja's kernels); on {device.type} with {backend} use quantization none (the "
            "weights expanded to dtype)"
        )
    if mode == "auto":
        return (gguf is not None or int4 is not None) and kernels
    return mode != "none"


def _quantize_at_load(model: CausalLM, kind: str) -> int:
    """--quantization int4 | int8 on the loaded model; how many projections it replaced."""
    before = resident_weight_bytes(model)
    replaced = quantize_loaded(model, kind)
    log.info(
        "%s weight-only quantization at load: %d projections; weights resident %.1f MB (%.1f MB "
        "before)",
        kind,
        replaced,
        resident_weight_bytes(model) / 1e6,
        before / 1e6,
    )
    return replaced


def _load_int4(
    model: CausalLM, path: str, checkpoint: Int4Checkpoint, slices: Slices | None
) -> int:
    """Loads an AWQ / GPTQ folder (each linear dequantized), then, where the checkpoint keeps
    them, swaps its linears for Int4Linears; logs the format and the weights' resident bytes
    against the packed ones; returns how many it swapped. With tensor-parallel `slices`, this
    rank's parts of each (a linear is unpacked whole, then cut)."""
    model.load_weights(narrowed(checkpoint.weights(iter_weights(path)), slices))
    sources = checkpoint.sources()
    sources = sources if slices is None else sources.sliced(slices)
    replaced = quantize_linears(model, sources, model.checkpoint_renames)
    checkpoint.packed.clear()
    fmt = checkpoint.fmt
    log.info(
        "%s int4 (group_size %d): %d layers kept quantized; weights resident %.1f MB "
        "(packed linears %.1f MB)",
        fmt.method.upper(),
        fmt.group_size,
        replaced,
        resident_weight_bytes(model) / 1e6,
        checkpoint.packed_bytes / 1e6,
    )
    return replaced


def _load_gguf(
    model: CausalLM,
    checkpoint: GGUFCheckpoint,
    keep_quantized: bool,
    on_cpu: bool,
    slices: Slices | None,
) -> int:
    """Loads a GGUF file's tensors (dequantized), then swaps the linears whose tensors were 4-bit
    for quantized ones (and, on the CPU, a quantized embedding for one over its blocks); logs
    the types and the weights' resident bytes against the file's; returns how many layers it
    swapped. With tensor-parallel `slices`, this rank's parts of each."""
    model.load_weights(narrowed(checkpoint.weights(keep_quantized), slices))
    quantized = checkpoint.quantized
    embedding = quantized.get("model.embed_tokens.weight")
    if model.tie_word_embeddings and embedding is not None:
        quantized.setdefault("lm_head.weight", embedding)  # a 4-bit one becomes an Int4Linear
    sources = gguf_int4(quantized)
    sources = sources if slices is None else sources.sliced(slices)
    replaced = quantize_linears(model, sources, model.checkpoint_renames)
    replaced += quantize_embedding(model, embedding, blocks=on_cpu)
    quantized.clear()
    types = sorted(set(checkpoint.types.values()))
    log.info(
        "GGUF %s: tensor types %s; %d layers kept quantized; weights resident %.1f MB "
        "(file tensors %.1f MB)",
        checkpoint.file.name,
        ",".join(types),
        replaced,
        resident_weight_bytes(model) / 1e6,
        checkpoint.tensor_bytes() / 1e6,
    )
    return replaced


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter, buffer and tensor attribute of `model`'s modules (quantized
    and oneDNN-packed weights included), each tensor once."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                tensors[id(value)] = value
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_dims(hf_config: HFConfig) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the KV cache."""
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return int(hf_config.num_hidden_layers), int(num_kv_heads), int(head_dim)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(path: str | Path, hf_config: HFConfig, tokenizer: Any) -> tuple[int, ...]:
    """Every token that ends generation: config.json's, generation_config.json's and the
    tokenizer's eos ids (each may be an int or a list), in that order, without repeats."""
    ids = _as_ids(getattr(hf_config, "eos_token_id", None))
    gen_file = Path(path).expanduser() / "generation_config.json"
    if gen_file.is_file():
        ids += _as_ids(json.loads(gen_file.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        ids += _as_ids(getattr(tokenizer, "eos_token_id", None))
    return tuple(dict.fromkeys(ids))


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""generation_config.json's settings that become a request's sampling defaults (vLLM's set)."""


def sampling_defaults(path: str | Path) -> dict[str, float]:
    """The sampling settings the checkpoint's generation_config.json sets (none for a GGUF file
    or a folder without one)."""
    gen_file = Path(path).expanduser() / "generation_config.json"
    if not gen_file.is_file():
        return {}
    values = json.loads(gen_file.read_text())
    return {k: float(values[k]) for k in SAMPLING_DEFAULT_KEYS if values.get(k) is not None}


def load_tokenizer(path: str | Path) -> Any:
    """The folder's tokenizer (AutoTokenizer, local files only), or the one in a GGUF file."""
    from transformers import AutoTokenizer

    gguf = find_gguf(path)
    if gguf is not None:
        return gguf_tokenizer(gguf)
    folder = _check_folder(path)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
