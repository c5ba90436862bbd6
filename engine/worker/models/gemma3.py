"""Gemma 3 (text): Gemma 2's layout plus a per-head (1 + w) norm of q and k, and two rotary
settings: local (sliding) layers and global layers each have their own base (and scaling),
picked by layer_types."""

from __future__ import annotations

import dataclasses

from engine.worker.models.gemma2 import Gemma2ForCausalLM
from engine.worker.models.layers.attention import AttentionSpec
from engine.worker.models.layers.norm import GemmaRMSNorm


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def attention_spec(self, layer: int) -> AttentionSpec:
        spec = super().attention_spec(layer)
        return dataclasses.replace(
            spec, qk_norm=GemmaRMSNorm, norm_eps=float(self.config.rms_norm_eps)
        )

    def rope_key(self, layer: int) -> str:
        rope = getattr(self.config, "rope_parameters", None)
        layer_type = str(self.config.layer_types[layer])
        return layer_type if isinstance(rope, dict) and layer_type in rope else "default"
