"""Gemma 2: (1 + w) RMSNorms in float32, a norm before and after both attention and MLP, GELU
(tanh), embeddings scaled by sqrt(hidden), attention scale query_pre_attn_scalar ** -0.5,
attention and final logit soft-capping, sliding and global layers alternating (layer_types)."""

from __future__ import annotations

import dataclasses
import math

from torch import nn

from engine.worker.models.base import CausalLM
from engine.worker.models.layers.attention import AttentionSpec
from engine.worker.models.layers.mlp import GatedMLP
from engine.worker.models.layers.norm import GemmaRMSNorm


class Gemma2ForCausalLM(CausalLM):
    norm_class = GemmaRMSNorm
    sandwich_norms = True

    def attention_spec(self, layer: int) -> AttentionSpec:
        cfg = self.config
        return dataclasses.replace(
            super().attention_spec(layer),
            scale=float(cfg.query_pre_attn_scalar) ** -0.5,
            logits_soft_cap=getattr(cfg, "attn_logit_softcapping", None),
        )

    def build_mlp(self, layer: int) -> nn.Module:
        cfg = (
            self.config
        )  # NOTE: Gemma reads hidden_activation (older configs also hold a hidden_act)
        act = str(getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh")
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, act, False, self.dtype)

    def embedding_scale(self) -> float | None:
        return math.sqrt(self.config.hidden_size)
