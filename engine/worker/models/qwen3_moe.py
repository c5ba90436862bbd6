"""Qwen3-MoE: Qwen3's attention; on sparse layers a mixture of experts routed by softmax, then
top-k, renormalized over the k chosen when norm_topk_prob; dense MLP on `mlp_only_layers`."""

from __future__ import annotations

from torch import nn

from engine.worker.models.layers.moe import MoESpec, SparseMoE
from engine.worker.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    supports_cuda_graphs = False  # the experts' token counts go to the host each layer

    def build_mlp(self, layer: int) -> nn.Module:
        cfg = self.config
        sparse = (
            layer not in (getattr(cfg, "mlp_only_layers", None) or [])
            and cfg.num_experts > 0
            and (layer + 1) % cfg.decoder_sparse_step == 0
        )
        if not sparse:
            return super().build_mlp(layer)
        spec = MoESpec(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            renormalize=bool(cfg.norm_topk_prob),
            act=cfg.hidden_act,
        )
        return SparseMoE(spec, self.dtype)
