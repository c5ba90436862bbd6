"""Qwen3 (dense): Llama with an explicit head_dim and a per-head RMSNorm of q and k before the
rotary."""

from __future__ import annotations

import dataclasses

from engine.worker.models.base import CausalLM
from engine.worker.models.layers.attention import AttentionSpec
from engine.worker.models.layers.norm import RMSNorm


class Qwen3ForCausalLM(CausalLM):
    def attention_spec(self, layer: int) -> AttentionSpec:
        spec = super().attention_spec(layer)
        return dataclasses.replace(spec, qk_norm=RMSNorm, norm_eps=float(self.config.rms_norm_eps))
