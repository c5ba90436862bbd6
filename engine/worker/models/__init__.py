"""Model families: maps a checkpoint's architecture to our implementation (one file a family,
over the shared decoder in base.py and the layers in layers/)."""

from __future__ import annotations

from typing import Any

from engine.worker.models.base import CausalLM
from engine.worker.models.gemma2 import Gemma2ForCausalLM
from engine.worker.models.gemma3 import Gemma3ForCausalLM
from engine.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from engine.worker.models.mixtral import MixtralForCausalLM
from engine.worker.models.phi3 import Phi3ForCausalLM
from engine.worker.models.qwen3 import Qwen3ForCausalLM
from engine.worker.models.qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "get_model_class", "model_family"]

SUPPORTED_ARCHITECTURES: dict[str, tuple[type[CausalLM], str]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, "llama"),
    "MistralForCausalLM": (LlamaForCausalLM, "llama"),
    "Qwen2ForCausalLM": (Qwen2ForCausalLM, "qwen2"),
    "Qwen3ForCausalLM": (Qwen3ForCausalLM, "qwen3"),
    "Qwen3MoeForCausalLM": (Qwen3MoeForCausalLM, "qwen3_moe"),
    "MixtralForCausalLM": (MixtralForCausalLM, "mixtral"),
    "Phi3ForCausalLM": (Phi3ForCausalLM, "phi3"),
    "Gemma2ForCausalLM": (Gemma2ForCausalLM, "gemma2"),
    "Gemma3ForCausalLM": (Gemma3ForCausalLM, "gemma3"),
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


def get_model_class(hf_config: Any) -> type[CausalLM]:
    """Our implementation of the checkpoint's architecture; ValueError if unsupported."""
    return SUPPORTED_ARCHITECTURES[_architecture(hf_config)][0]


def model_family(hf_config: Any) -> str:
    """The family name of the checkpoint's architecture (Mistral counts as llama)."""
    return SUPPORTED_ARCHITECTURES[_architecture(hf_config)][1]
