"""Model families: maps a checkpoint's architecture to our implementation."""

from __future__ import annotations

from typing import Any

from engine.worker.models.llama import LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "get_model_class", "model_family"]

SUPPORTED_ARCHITECTURES: dict[str, tuple[type, str]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, "llama"),
    "MistralForCausalLM": (LlamaForCausalLM, "llama"),
    "Qwen2ForCausalLM": (LlamaForCausalLM, "qwen2"),
}
"""architectures[0] -> (our class, family name)."""


def _architecture(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError(
            "config.json names no architecture; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    arch = str(archs[0])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return arch


def _check_sliding_window(hf_config: Any, arch: str) -> None:
    """Rejects checkpoints whose attention uses a sliding window shorter than the context."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None or getattr(hf_config, "use_sliding_window", True) is False:
        return
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return
    max_positions = hf_config.max_position_embeddings
    if window < max_positions:
        raise ValueError(
            f"{arch} with sliding_window={window} < max_position_embeddings={max_positions} is "
            "not supported (sliding-window attention is not implemented)"
        )


def get_model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """Our implementation of the checkpoint's architecture; ValueError if unsupported."""
    arch = _architecture(hf_config)
    _check_sliding_window(hf_config, arch)
    return SUPPORTED_ARCHITECTURES[arch][0]


def model_family(hf_config: Any) -> str:
    """ "llama" or "qwen2" (Mistral counts as llama)."""
    return SUPPORTED_ARCHITECTURES[_architecture(hf_config)][1]
