"""Mixtral: Mistral's attention with a mixture of experts in every layer, routed by softmax over
the top-k router logits (softmax, top-k, renormalize), weights scaled in float32. Checkpoints name
the block `block_sparse_moe` and each expert's gate/down/up projections w1/w2/w3."""

from __future__ import annotations

from torch import nn

from engine.worker.models.base import CausalLM
from engine.worker.models.layers.moe import MoESpec, SparseMoE


class MixtralForCausalLM(CausalLM):
    supports_cuda_graphs = False  # the experts' token counts go to the host each layer
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    def build_mlp(self, layer: int) -> nn.Module:
        cfg = self.config
        spec = MoESpec(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_experts=cfg.num_local_experts,
            top_k=cfg.num_experts_per_tok,
            renormalize=True,
            act=cfg.hidden_act,
            weights_in_model_dtype=False,
            expert_names=("w1", "w3", "w2"),
        )
        return SparseMoE(spec, self.dtype)
