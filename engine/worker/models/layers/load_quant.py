"""Load-time weight-only quantization of a plain checkpoint (`--quantization int4|int8`, like
torchao's weight-only configs): each projection rounded to nearest into the kept layers of
layers/quantized.py (4-bit groups of 32, or 8-bit with one scale a row repeated to groups), or an
Int8Linear where its inputs are not whole groups."""

from __future__ import annotations

import torch
from torch import nn

from engine.worker.models.layers.group_rows import GROUP, Int4Rows, Q8Rows
from engine.worker.models.layers.quantized import Int4Linear, Q8Linear, fits


def _per_channel_int8(
    weight: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """q int8 [N, K] and its float32 scale a row: symmetric, scale absmax / 127 rounded to
    `dtype` first (as stored), q the nearest value given it."""
    w = weight.detach().float()
    tiny = torch.finfo(dtype).tiny  # an all-zero row: a scale the dtype holds
    scale = (w.abs().amax(dim=1) / 127).to(dtype).float().clamp(min=tiny)
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


def rtn_int8(weight: torch.Tensor) -> Q8Rows:
    """A weight [N, K] rounded to nearest per output channel (`_per_channel_int8` in the
    weight's dtype), its scale repeated to groups of 32 (a Q8Linear's rows)."""
    q, scale = _per_channel_int8(weight, weight.dtype)
    groups = scale[:, None].expand(-1, q.shape[1] // GROUP)
    return Q8Rows(q.numpy(), groups.contiguous().numpy())


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W int8 [out, in] and one scale a row (per channel, symmetric: w = q *
    scale), for a load-time int8 weight whose inputs are not whole groups of 32 (a Q8Linear
    takes the others); torch's int8 weight-only kernel in 16 bits on the CPU, the weight expanded
    per call in float32 and on CUDA (exact against the dequantized weight in float32)."""

    weight_int8: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = _per_channel_int8(weight, dtype)
        self.register_buffer("weight_int8", q.contiguous(), persistent=False)
        self.register_buffer("scales", scale.to(dtype), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        if flat.dtype == torch.float32 or flat.device.type != "cpu":
            w = self.weight_int8.to(flat.dtype) * self.scales.to(flat.dtype)[:, None]
            out = flat @ w.T
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def rtn_int4(weight: torch.Tensor) -> Int4Rows:
    """A weight [N, K] rounded to nearest in asymmetric groups of 32 (min / max), in Int4Linear's
    convention, with the scale and zero rounded to the weight's dtype first (as they are stored)
    so that q is the nearest value given them."""
    dtype = weight.dtype
    n, k = weight.shape
    g = weight.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).to(dtype).float().clamp(min=torch.finfo(dtype).tiny)
    zero = (lo + 8 * scale).to(dtype).float()
    q = torch.clamp(torch.round((g - zero[..., None]) / scale[..., None]) + 8, 0, 15)
    return Int4Rows(q.reshape(n, k).to(torch.int32).numpy(), scale.numpy(), zero.numpy())


def quantize_loaded(model: nn.Module, kind: str) -> int:
    """Load-time weight-only quantization (`--quantization int4|int8`): every attention and MLP
    projection (an nn.Linear named *_proj; not the LM head, the router or the experts) becomes an
    Int4Linear (rtn_int4) or a Q8Linear (rtn_int8; an Int8Linear where the inputs are not whole
    groups); returns how many. Call after loading, on the CPU.

    Under tensor parallelism each rank quantizes its shard: int4 groups run along a row's inputs,
    so where a rank's share of a row-parallel layer's inputs is a multiple of 32 the groups are
    those of one rank; int8's per-row scale is then of the rank's share of the row."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not name.endswith("_proj"):
            continue
        dtype = module.weight.dtype
        layer: nn.Module
        if kind == "int8" and fits(module.out_features, module.in_features):
            layer = Q8Linear(*rtn_int8(module.weight), module.bias, dtype)
        elif kind == "int8":
            layer = Int8Linear(module.weight, module.bias, dtype)
        elif fits(module.out_features, module.in_features):
            layer = Int4Linear(*rtn_int4(module.weight), module.bias, dtype)
        else:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, layer)
        replaced += 1
    return replaced
