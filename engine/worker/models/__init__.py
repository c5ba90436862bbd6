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


def get_model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """Our implementation of the checkpoint's architecture; ValueError if unsupported."""
    return SUPPORTED_ARCHITECTURES[_architecture(hf_config)][0]


def model_family(hf_config: Any) -> str:
    """ "llama" or "qwen2" (Mistral counts as llama)."""
    return SUPPORTED_ARCHITECTURES[_architecture(hf_config)][1]
