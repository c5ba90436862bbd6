"""A sparse mixture-of-experts block, batched over the step's tokens.

Route: router logits [T, E] -> float32 softmax -> top-k experts per token, renormalized over the
k chosen where the family does (Mixtral always; Qwen3-MoE with norm_topk_prob). Then the T * k
(token, expert) pairs are sorted by expert, so each expert's tokens are one contiguous run, and
each expert runs ONE GEMM (per projection) over its run. The outputs, scaled by their routing
weights, are scatter-added back to their tokens. No loop over tokens, none over idle experts:
- on a GPU (and on the CPU before packing): torch's grouped GEMM (`torch._grouped_mm`, the
  CUTLASS grouped kernel on Hopper), one call for all experts with no host sync: the expert
  offsets stay on the device, so the step keeps its single sync and stays graph-capturable;
- on the CPU after `pack_for_cpu`: each expert's weights packed for oneDNN (PackedLinear) and a
  loop over the experts that got tokens (the counts come to the host, which costs nothing on a
  CPU). NOTE: packed per-expert GEMMs beat the grouped GEMM here (it runs unpacked fp32 / bf16
  matmuls one expert at a time in C++), the same 1.5-3x that packing gives dense layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.models.layers.linear import PackedLinear, bucket_rows, new_linear
from engine.worker.models.layers.mlp import activation
from engine.worker.models.layers.weights import Shard


@dataclass(frozen=True, slots=True)
class MoESpec:
    hidden_size: int
    intermediate_size: int
    """Each expert's MLP width."""
    num_experts: int
    top_k: int
    renormalize: bool
    """Divide the k chosen probabilities by their sum."""
    act: str = "silu"
    weights_in_model_dtype: bool = True
    """Cast the routing weights to the model dtype before scaling (Qwen3-MoE) or scale in
    float32 and cast the product (Mixtral), as each family's reference does."""
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """The checkpoint's names of each expert's gate, up and down projections."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.top_k}"
            )


class Experts(nn.Module):
    """Every expert's weights as two 3D tensors (transformers' own layout, so checkpoints saved
    fused load as they are): gate_up_proj [E, 2I, H] ([gate | up] rows), down_proj [E, H, I]."""

    def __init__(self, spec: MoESpec, dtype: torch.dtype) -> None:
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.spec = spec
        self.act = activation(spec.act)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype))
        # NOTE: the grouped GEMM needs 16-byte aligned strides (every real checkpoint has them).
        self.grouped = hasattr(torch, "_grouped_mm") and h % 8 == 0 and i % 8 == 0
        self.packed: nn.ModuleList | None = None
        """After pack_for_cpu: [gate_up_e, down_e] PackedLinears of every expert e, in order."""

    def pack_for_cpu(self) -> None:
        """Packs each expert's two weights for oneDNN and drops the 3D tensors (load first)."""
        layers = []
        for e in range(self.spec.num_experts):
            layers += [PackedLinear(self.gate_up_proj[e]), PackedLinear(self.down_proj[e])]
        self.packed = nn.ModuleList(layers)
        self.grouped = False
        del self.gate_up_proj, self.down_proj

    def checkpoint_shards(self) -> dict[str, Shard]:
        """`{e}.{gate|up|down}.weight` (per-expert checkpoint tensors) -> slices of ours."""
        gate, up, down = self.spec.expert_names
        size = self.spec.intermediate_size
        out = {}
        for e in range(self.spec.num_experts):
            out[f"{e}.{gate}.weight"] = Shard("gate_up_proj", 0, size, expert=e)
            out[f"{e}.{up}.weight"] = Shard("gate_up_proj", size, size, expert=e)
            out[f"{e}.{down}.weight"] = Shard("down_proj", 0, self.spec.hidden_size, expert=e)
        return out

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [N, H] rows sorted by expert, counts: [E] rows per expert -> [N, H]."""
        if self.grouped:
            offs = counts.cumsum(0).to(torch.int32)  # [E] end row of each expert's run
            h = torch._grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs=offs)  # [N, 2I]
            gate, up = h.chunk(2, dim=-1)
            return torch._grouped_mm(self.act(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        if self.packed is not None:
            return self._packed_forward(x, counts)
        out = torch.empty_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):  # one host sync; idle experts are skipped
            if n:
                gate, up = F.linear(x[start : start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
                out[start : start + n] = F.linear(self.act(gate) * up, self.down_proj[e])
                start += n
        return out

    def _packed_linear(self, i: int) -> PackedLinear:
        """packed[i]: expert i // 2's gate_up (even i) or down (odd i) projection."""
        assert self.packed is not None
        return cast(PackedLinear, self.packed[i])

    def _packed_forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The CPU path: x padded once so that every active expert's run is a whole row bucket
        (`bucket_rows`, which bounds oneDNN's kernel cache), one packed GEMM per active expert and
        projection (PackedLinear.apply_rows: no per-call pad), the activation once over all rows
        between the two rounds."""
        assert self.packed is not None
        runs = [(e, n, bucket_rows(n)) for e, n in enumerate(counts.tolist()) if n]  # host sync
        width = x.shape[1]
        if any(n != b for _, n, b in runs):
            padded = x.new_zeros(sum(b for _, _, b in runs), width)  # [P, H]
            src = dst = 0
            for _, n, b in runs:
                padded[dst : dst + n] = x[src : src + n]
                src, dst = src + n, dst + b
            x = padded
        gate_up, start = [], 0
        for e, _, b in runs:  # [b, 2I] per expert
            gate_up.append(self._packed_linear(2 * e).apply_rows(x[start : start + b]))
            start += b
        gate, up = torch.cat(gate_up).chunk(2, dim=-1)  # [P, I] each
        hidden = self.act(gate) * up  # [P, I]
        down, start = [], 0
        for e, n, b in runs:  # [n, H] per expert, padding rows dropped
            down.append(self._packed_linear(2 * e + 1).apply_rows(hidden[start : start + b])[:n])
            start += b
        return torch.cat(down)


class SparseMoE(nn.Module):
    """Router (`gate`, a [E, H] linear) plus the experts; x: [T, H] -> [T, H]."""

    def __init__(self, spec: MoESpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.gate = new_linear(spec.hidden_size, spec.num_experts, False, dtype)
        self.experts = Experts(spec, dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, ids = torch.topk(probs, self.spec.top_k, dim=-1)  # [T, k]
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, k = x.shape[0], self.spec.top_k
        weights, ids = self.route(x)
        # each token's k choices in ascending expert order: the reference adds them up that way
        ids, choice = ids.sort(dim=1)  # [T, k]
        weights = weights.gather(1, choice)  # [T, k]
        flat = ids.reshape(-1)  # [T * k] expert of each (token, choice) pair
        order = flat.argsort(stable=True)  # [T * k] pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.spec.num_experts)  # [E]
        out = self.experts(x.index_select(0, order // k), counts)  # [T * k, H] sorted pairs
        pairs = torch.empty_like(out).index_copy_(0, order, out).view(t, k, -1)  # [T, k, H]
        w = weights.unsqueeze(-1)  # [T, k, 1]
        if self.spec.weights_in_model_dtype:
            pairs = pairs * w.to(x.dtype)
        else:
            pairs = (pairs * w).to(x.dtype)
        acc = pairs[:, 0]
        for j in range(1, k):  # k is the routing fan-out (2-8), not a loop over tokens
            acc = acc + pairs[:, j]  # left to right: the reference's index_add_ over experts
        return acc  # [T, H]
