"""deja's engine: paged KV cache, prefix caching, continuous batching, our own forward pass."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.sample.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.frontend.llm import LLM

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from engine.frontend.llm import LLM

        return LLM
    raise AttributeError(name)
