"""The engine core's parts, built from the config and the loaded model (`EngineCore.__init__`
reads as a list of these)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.core.remote_loads import RemoteLoads
from engine.kv.events import KVEventBuffer
from engine.kv.manager import KVCacheManager
from engine.kv.tiers import TieredCache
from engine.stats import ModelInfo
from engine.worker.cpu_features import resolve_device, resolve_dtype
from engine.worker.model_loader import resident_weight_bytes
from engine.worker.models.sliding_window import kv_window, layer_windows
from engine.worker.worker import Worker


def resolve_config(config: EngineConfig) -> EngineConfig:
    """The config with 'auto' device and dtype decided for this machine (everything below sees
    them), after setting this thread's torch threads."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.model.dtype, device.type)
    return replace(config, device=device.type, model=replace(config.model, dtype=dtype))


def max_model_len(model: ModelConfig, hf_config: Any) -> int:
    """The longest sequence: `model.max_model_len`, else the model's max_position_embeddings;
    ValueError when the first exceeds the second."""
    max_pos = int(getattr(hf_config, "max_position_embeddings", 2048))
    if model.max_model_len is not None and model.max_model_len > max_pos:
        raise ValueError(
            f"max_model_len {model.max_model_len} exceeds the model's max_position_embeddings "
            f"{max_pos}"
        )
    return model.max_model_len or max_pos


def model_info(
    config: EngineConfig,
    worker: Worker,
    tokenizer: Any,
    eos_token_ids: tuple[int, ...],
    max_len: int,
    sampling_defaults: dict[str, float],
) -> ModelInfo:
    """What the engine tells its callers about the model and its KV pool (sized here: the
    device budget in blocks of rank 0's cache)."""
    mc, cc, shape = config.model, config.cache, worker.shape
    hf_config = shape.hf_config
    # A draft model's cache has a block for each of the target's: the budget holds both.
    per_block = worker.block_bytes + worker.draft_block_bytes
    num_blocks = cc.num_device_blocks or max(1, int(cc.device_memory_gib * 2**30) // per_block)
    return ModelInfo(
        model_id=mc.model_id or os.path.basename(os.path.normpath(mc.path)),
        family="qwen2" if hf_config.model_type == "qwen2" else "llama",
        architecture=(hf_config.architectures or ["LlamaForCausalLM"])[0],
        max_model_len=max_len,
        block_size=cc.block_size,
        dtype=mc.dtype,
        kv_cache_dtype=cc.kv_cache_dtype,
        vocab_size=shape.vocab_size,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        num_device_blocks=num_blocks,
        eos_token_ids=eos_token_ids,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        sampling_defaults=tuple(sorted(sampling_defaults.items())),
        speculative_method=None if config.speculative is None else config.speculative.method,
        quantization=worker.model.weight_quantization,
        weight_bytes=resident_weight_bytes(worker.model),
    )


def kv_event_buffer(cache: CacheConfig) -> KVEventBuffer | None:
    """The KV events' buffer, when they are asked for (and there is a prefix cache)."""
    if cache.kv_events_max_blocks and cache.enable_prefix_caching:
        return KVEventBuffer(cache.kv_events_max_blocks, cache.block_size)
    return None


def kv_cache_manager(
    cache: CacheConfig,
    info: ModelInfo,
    hf_config: Any,
    tiers: TieredCache | None,
    events: KVEventBuffer | None,
) -> KVCacheManager:
    # NOTE: blocks leave a sequence as its window moves on only when every layer slides;
    # swap preemption holds a sequence's whole table in the CPU tier, so it keeps them all.
    window = kv_window(layer_windows(hf_config)) if cache.preemption_mode != "swap" else None
    return KVCacheManager(
        info.num_device_blocks,
        cache.block_size,
        enable_caching=cache.enable_prefix_caching,
        max_pinned_fraction=cache.max_pinned_fraction,
        tiers=tiers,
        events=events,
        sliding_window=window,
    )


def remote_loads(kv: KVCacheManager, tiers: TieredCache | None) -> RemoteLoads | None:
    """The lookups of requests waiting on the remote tier (None: no remote tier)."""
    if tiers is None or tiers.remote is None:
        return None
    return RemoteLoads(kv, tiers, tiers.remote)
