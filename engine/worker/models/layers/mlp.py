"""The gated MLP (down(act(gate(x)) * up(x))) with gate and up fused into one projection, and
the activations the families use."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.models.layers.linear import new_linear

if TYPE_CHECKING:
    from engine.worker.parallel.group import TPGroup

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
    With a tensor-parallel group: this rank's rows of the intermediate (column-parallel gate/up,
    row-parallel down_proj summed over the ranks; down_proj's bias on rank 0 alone).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str,
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.start = 0
        if tp is not None:
            self.start, intermediate = tp.rows(intermediate)
        self.intermediate_size = intermediate
        self.act = activation(act)
        self.kernel: Any = None
        """Ops with `silu_and_mul` (cuda/layers.py) for a SiLU MLP, or None: torch ops."""
        self.gate_up_proj = new_linear(hidden, 2 * intermediate, bias, dtype)
        down_bias = bias and (tp is None or tp.rank == 0)
        self.down_proj = new_linear(intermediate, hidden, down_bias, dtype)

    def checkpoint_shards(self) -> dict[str, tuple[str, int, int]]:
        """checkpoint name (relative to this module) -> (our parameter, first row, rows)."""
        size = self.intermediate_size
        out = {}
        for suffix in ("weight", "bias"):
            out[f"gate_proj.{suffix}"] = (f"gate_up_proj.{suffix}", 0, size)
            out[f"up_proj.{suffix}"] = (f"gate_up_proj.{suffix}", size, size)
        return out

    def tp_slices(self) -> dict[str, tuple[int, int, int] | None]:
        """Checkpoint name -> (dim, start, length) this rank reads; None: not on this rank."""
        rows = (0, self.start, self.intermediate_size)
        out: dict[str, tuple[int, int, int] | None] = {}
        for suffix in ("weight", "bias"):
            out[f"gate_proj.{suffix}"] = out[f"up_proj.{suffix}"] = rows
        out["down_proj.weight"] = (1, self.start, self.intermediate_size)
        if self.down_proj.bias is None:
            out["down_proj.bias"] = None
        return out

    def use_kernel(self, ops: Any) -> None:
        """Computes act(gate) * up with ops.silu_and_mul (one launch) where the act is SiLU."""
        if self.act is F.silu and hasattr(ops, "silu_and_mul"):
            self.kernel = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        if self.kernel is not None:
            h = self.kernel.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
            h = self.act(gate) * up
        out = self.down_proj(h)  # [T, hidden]
        if self.tp is not None:
            self.tp.all_reduce(out)  # the other ranks' rows' share
        return out
