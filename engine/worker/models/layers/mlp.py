"""The gated MLP (down(act(gate(x)) * up(x))) with gate and up fused into one projection, and
the activations the families use."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.models.layers.linear import new_linear

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}
"""transformers' hidden_act names -> the same function."""


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called `name` in config.json; ValueError naming the supported ones."""
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise ValueError(
            f"hidden activation {name!r} is not supported; supported: " + ", ".join(ACTIVATIONS)
        )
    return fn


class GatedMLP(nn.Module):
    """down_proj(act(gate) * up) with [gate | up] = gate_up_proj(x).

    Checkpoints store gate_proj and up_proj apart (Llama, Qwen, Gemma) or fused as gate_up_proj
    (Phi-3); `checkpoint_shards` maps the separate pieces onto the fused weight.
    """

    def __init__(
        self, hidden: int, intermediate: int, act: str, bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate
        self.act = activation(act)
        self.gate_up_proj = new_linear(hidden, 2 * intermediate, bias, dtype)
        self.down_proj = new_linear(intermediate, hidden, bias, dtype)

    def checkpoint_shards(self) -> dict[str, tuple[str, int, int]]:
        """checkpoint name (relative to this module) -> (our parameter, first row, rows)."""
        size = self.intermediate_size
        out = {}
        for suffix in ("weight", "bias"):
            out[f"gate_proj.{suffix}"] = (f"gate_up_proj.{suffix}", 0, size)
            out[f"up_proj.{suffix}"] = (f"gate_up_proj.{suffix}", size, size)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)  # [T, hidden]
