"""Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2, TinyLlama, Mistral and Qwen2: the shared
decoder as it is (models/base.py), with Qwen2's q/k/v bias."""

from __future__ import annotations

import dataclasses

from engine.worker.models.base import CausalLM
from engine.worker.models.layers.attention import AttentionSpec


class LlamaForCausalLM(CausalLM):
    """Llama and Mistral: pre-norm RMSNorm, fused q/k/v and gate/up, SiLU, rotary."""

    supports_tensor_parallel = True


class Qwen2ForCausalLM(CausalLM):
    """Qwen2: Llama with a bias on q/k/v (not on o_proj)."""

    supports_tensor_parallel = True

    def attention_spec(self, layer: int) -> AttentionSpec:
        return dataclasses.replace(super().attention_spec(layer), qkv_bias=True, o_bias=False)
