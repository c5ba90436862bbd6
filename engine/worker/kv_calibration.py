"""The scales of an fp8 KV cache: from the checkpoint, or from a calibration pass at start.

Calibration runs the model once over CALIBRATION_TEXTS (prose, a chat turn, code, numbers), as
one prefill batch into a small temporary cache in the model's dtype, while the attention backend
reports each layer's new K and V (`AttentionBackend.kv_observer`). Each layer's scale is the
power of two that puts CALIBRATION_MARGIN x the largest |K| (|V|) seen at or under e4m3's 448
(engine/worker/attention/kv_quant.py). It costs one forward of ~400 tokens at start.
The disk tier's stored scales take precedence over a new calibration (engine/kv_io/tier_setup.py's
`stored_kv_scales`), so blocks written before a restart stay readable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.kv_io.tier_setup import TPShare, rank_disk, stored_kv_scales
from engine.worker.attention.base import AttentionBackend, AttentionMetadata
from engine.worker.attention.kv_quant import (
    CHECKPOINT_SCALE,
    FP8_DTYPE,
    KVScales,
    kv_storage_dtype,
    pow2_scale,
)
from engine.worker.model_loader import safetensors_files

CALIBRATION_TEXTS = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Within "
    "fifty years, presses operated in more than two hundred European cities, and the cost of "
    "books fell so far that literacy spread well beyond monasteries and universities.",
    "User: What is the capital of France, and why did it become the capital?\n"
    "Assistant: The capital of France is Paris. It grew around the Île de la Cité on the Seine, "
    "became the seat of the Capetian kings, and has been the political centre ever since.",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n",
    "Quarterly results: revenue 4,812.3 (+12.5%), operating margin 18.2%, 1,024 employees; "
    "2019 2020 2021 2022 2023; 3.14159 2.71828 1.41421; #42, $19.99, 7/11, 100%, 0x1F.",
)
"""Prompts the calibration pass runs (mixed on purpose: prose, chat, code, numbers)."""
MAX_TOKENS_PER_TEXT = 256


def checkpoint_kv_scales(files: list[Path], num_layers: int) -> KVScales | None:
    """The checkpoint's `layers.N.self_attn.k_scale` / `v_scale` tensors as KVScales, or None
    when it has none; ValueError when some layer lacks one."""
    from safetensors import safe_open

    found: dict[tuple[str, int], float] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = CHECKPOINT_SCALE.search(name)
                if m is not None:
                    found[(m.group(2), int(m.group(1)))] = float(f.get_tensor(name).float().max())
    if not found:
        return None
    missing = [
        f"{kind}_scale of layer {i}"
        for kind in "kv"
        for i in range(num_layers)
        if (kind, i) not in found
    ]
    if missing:
        raise ValueError(f"the checkpoint's KV scales are incomplete: no {', '.join(missing[:4])}")
    return KVScales(
        tuple(found[("k", i)] for i in range(num_layers)),
        tuple(found[("v", i)] for i in range(num_layers)),
        source="checkpoint",
    )


def prefill_meta(lengths: list[int], block_size: int, device: torch.device) -> AttentionMetadata:
    """One prefill batch of sequences with `lengths` new tokens, each in its own blocks, laid out
    one after another from block 0."""
    blocks = [-(-n // block_size) for n in lengths]
    max_blocks = max(blocks)
    tables = torch.zeros((len(lengths), max_blocks), dtype=torch.int32)
    slots: list[int] = []
    first = 0
    for s, (n, nb) in enumerate(zip(lengths, blocks, strict=True)):
        tables[s, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        slots += range(first * block_size, first * block_size + n)
        first += nb
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_lens_cpu=list(lengths),
        seq_lens_cpu=list(lengths),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
    )


def kv_cache_storage(
    kv_cache_dtype: str, model_dtype: torch.dtype, backend: AttentionBackend
) -> torch.dtype:
    """The KV cache's dtype for CacheConfig.kv_cache_dtype; ValueError for fp8 with a backend
    that cannot read it."""
    dtype = kv_storage_dtype(kv_cache_dtype, model_dtype)
    if dtype == FP8_DTYPE and not backend.supports_fp8_kv:
        raise ValueError(
            f"kv_cache_dtype 'fp8_e4m3' is not supported by the {backend.name!r} attention "
            "backend; use attention_backend='torch' or kv_cache_dtype='auto'"
        )
    return dtype


@dataclass(frozen=True, slots=True)
class KVCalibration:
    """What a calibration pass runs: the loaded model, its backend and tokenizer."""

    model: Any
    backend: AttentionBackend
    tokenizer: Any
    max_model_len: int
    peers: Callable[[list[list[int]]], None] | None = None
    """Tensor parallelism: starts the same pass on the other ranks (they join its collectives
    and the maximum over ranks); called with the prompts' token ids."""


@torch.inference_mode()
def calibrate_kv_scales(run: KVCalibration, kv_shape: tuple[int, int, int, int]) -> KVScales:
    """Per-layer K and V scales from one forward over CALIBRATION_TEXTS.

    kv_shape: (num_layers, block_size, num_kv_heads, head_dim). The temporary cache has the
    model's dtype, on its device; the backend's observer is removed afterwards (the caller binds
    the real cache).
    """
    limit = min(MAX_TOKENS_PER_TEXT, run.max_model_len)
    texts = CALIBRATION_TEXTS
    prompts = [run.tokenizer.encode(t, add_special_tokens=False)[:limit] for t in texts]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError("the tokenizer gave no tokens for the KV-scale calibration texts")
    if run.peers is not None:
        run.peers(prompts)
    return calibration_pass(run.model, run.backend, prompts, kv_shape)


@torch.inference_mode()
def calibration_pass(
    model: Any, backend: AttentionBackend, prompts: list[list[int]], kv_shape: tuple[int, ...]
) -> KVScales:
    """The forward of `calibrate_kv_scales` over token ids; with a tensor-parallel model every
    rank runs it (over its own KV heads) and each layer's maximum is taken over the ranks, so
    every rank gets the scales one rank would."""
    weight = next(model.parameters())
    dtype, device = weight.dtype, weight.device
    num_layers, block_size, num_kv_heads, head_dim = kv_shape
    lengths = [len(p) for p in prompts]
    meta = prefill_meta(lengths, block_size, device)
    num_blocks = sum(-(-n // block_size) for n in lengths)
    cache = torch.zeros(
        (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
    )
    amax = torch.zeros((num_layers, 2), dtype=torch.float32, device=device)

    def observe(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [T, Hkv, D]
        amax[layer, 0] = torch.maximum(amax[layer, 0], k.abs().max().float())
        amax[layer, 1] = torch.maximum(amax[layer, 1], v.abs().max().float())

    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)
    positions = torch.tensor([i for n in lengths for i in range(n)], dtype=torch.int64)
    backend.bind_kv_cache(cache, None)
    backend.kv_observer = observe
    try:
        backend.prepare(meta)
        model(input_ids, positions.to(device), cache, meta)
    finally:
        backend.kv_observer = None
    tp = getattr(model, "tp", None)
    if tp is not None:
        tp.all_reduce_max(amax)
    found = amax.cpu().tolist()  # [num_layers][2]
    return KVScales(
        tuple(pow2_scale(row[0]) for row in found),
        tuple(pow2_scale(row[1]) for row in found),
        source="calibrated",
    )


@dataclass(frozen=True, slots=True)
class KVScaleSources:
    """Where an fp8 cache's scales may already be stored."""

    model_path: str
    """The checkpoint folder (its `k_scale` / `v_scale` tensors)."""
    disk_dir: str | None
    """The disk tier's folder (its manifest's `kv_scales`); None: no disk tier."""
    disk_manifest: dict[str, Any]
    """This engine's disk manifest without scales (engine/kv_io/tier_setup.py's disk_manifest)."""
    tp: TPShare | None = None
    """Rank 0's share with N > 1: the scales are those of its own folder's blocks."""


def resolve_kv_scales(
    sources: KVScaleSources, run: KVCalibration, kv_shape: tuple[int, int, int, int]
) -> KVScales:
    """An fp8 cache's scales: the checkpoint's; else those the disk tier's blocks were written
    with (a restart, or a replica sharing the folder); else a calibration pass (`run`).

    kv_shape: (num_layers, block_size, num_kv_heads, head_dim)."""
    found = checkpoint_kv_scales(safetensors_files(sources.model_path), kv_shape[0])
    if found is not None:
        return found
    if sources.disk_dir:
        folder, manifest = rank_disk(sources.disk_dir, sources.disk_manifest, sources.tp)
        stored = stored_kv_scales(folder, manifest)
        if stored is not None:
            return KVScales.from_json(stored, source="disk")
    return calibrate_kv_scales(run, kv_shape)
