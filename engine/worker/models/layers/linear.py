"""Linear layers: uninitialized construction (weights come from the checkpoint) and the CPU's
oneDNN-packed form (PackedLinear), with the row buckets that bound its kernel cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def new_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    """An nn.Linear [out, in] left uninitialized: every weight comes from the checkpoint."""
    return torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype)


class PackedLinear(nn.Module):
    """nn.Linear for CPU inference: the weight reordered once, at load, into oneDNN's blocked
    layout, and applied with oneDNN's linear (the ops torch inductor's freezing pass emits).

    NOTE: F.linear on a plain [out, in] weight reorders it on every call in bfloat16, which made
    bf16 decoding slower than float32 here. Packed, the demo model's matrix-vector products run
    2-7x faster in bf16 (the 49152 x 576 LM head: 4.2 -> 0.6 ms at one row) and 1.5-3x in float32
    at 16+ rows; see README "CPU speed". oneDNN picks the bf16 units (avx512_bf16, AMX) where the
    CPU has them. The packed tensor is opaque (mkldnn layout): it is not a Parameter and is not in
    the state dict; load weights before packing.
    """

    def __init__(self, linear: nn.Linear | torch.Tensor, batch_hint: int | None = None) -> None:
        """linear: an nn.Linear, or a bare [out, in] weight (no bias). batch_hint: the row count
        oneDNN lays the weight out for (default: `default_batch_hint` of its dtype)."""
        super().__init__()
        weight = (linear.weight if isinstance(linear, nn.Linear) else linear).detach()
        self.out_features, self.in_features = weight.shape
        if batch_hint is None:
            batch_hint = default_batch_hint(weight.dtype)
        self.weight_packed = torch.ops.mkldnn._reorder_linear_weight(
            weight.contiguous(), batch_hint
        )
        bias = linear.bias if isinstance(linear, nn.Linear) else None
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]; rows padded to a bucket (see bucket_rows), then cut back
        flat = x.reshape(-1, self.in_features)  # [M, in]
        rows = flat.shape[0]
        padded = bucket_rows(rows)
        if padded != rows:
            flat = F.pad(flat, (0, 0, 0, padded - rows))  # [bucket, in]
        out = self.apply_rows(flat)  # [bucket, out]
        return out[:rows].view(*x.shape[:-1], self.out_features)

    def apply_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[M, in] -> [M, out] as it is: the caller has made M a row bucket (`bucket_rows`)."""
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            rows, self.weight_packed, self.bias, "none", [], ""
        )
        return out


def default_batch_hint(dtype: torch.dtype) -> int:
    """The row count a weight is packed for: 16 in float32, 1 otherwise.

    NOTE: measured on a 2-core Xeon (AVX-512, AMX), torch 2.13: a float32 weight packed for 16
    rows runs 1.2-1.8x faster than one packed for 1 row at every M from 4 to 64 and as fast or
    faster at M = 1 (the demo model's down_proj: 217 -> 125 us at one row; a 512 x 1024 expert
    at 16 rows: 140 -> 86 us). In bfloat16 (AMX / avx512_bf16 kernels) the hint moved nothing
    consistently, and 1 was best at 64 rows, so it stays 1 there.
    """
    return 16 if dtype == torch.float32 else 1


def bucket_rows(rows: int) -> int:
    """The row count a PackedLinear computes for `rows` input rows: exact up to 16, then rounded
    up to a step of 1/8 of the power of two below: at most 12.5% more rows, 8 shapes an octave.

    NOTE: oneDNN builds and caches one kernel (primitive, ~0.5 MB) per input shape, up to 1,024 of
    them: with every batch size its own shape, a serving process grew by ~1 GB (the soak test
    caught it). Buckets bound it to ~70 shapes per weight up to 2,048 rows (~35 MB of kernels per weight).
    """
    if rows <= 16:
        return rows
    step = (1 << (rows.bit_length() - 1)) // 8
    return -(-rows // step) * step


SMALL_FLOAT32_WEIGHT = 1 << 16
"""Float32 weights with fewer elements than this stay plain nn.Linear (see `worth_packing`)."""


def worth_packing(weight: torch.Tensor) -> bool:
    """Whether a PackedLinear beats F.linear on this weight: every weight but a small float32 one.

    NOTE: oneDNN's packed linear costs ~20-25 us a call whatever the shape, where F.linear on a
    small float32 weight goes to MKL's sgemm in ~3 us (2-core AMD EPYC, torch 2.13: 192 x 64 at
    one row 3.5 vs 28 us, at 16 rows 9 vs 29 us; at 256 rows within 25% either way). Small
    weights are the tiny test models' layers and the MoE router gate ([experts, hidden]). In
    bfloat16 F.linear goes through oneDNN too (~18 us), so every bf16 weight is packed.
    """
    return not (weight.dtype == torch.float32 and weight.numel() < SMALL_FLOAT32_WEIGHT)


def pack_linears(model: nn.Module) -> bool:
    """Replaces every nn.Linear under `model` that is `worth_packing` by its PackedLinear (CPU
    only, after loading), and lets every module with a `pack_for_cpu()` method (e.g. the experts)
    pack its own weights.

    Returns False, leaving every layer as it was, where oneDNN cannot pack this dtype on this CPU
    (bf16 without AVX-512 or AVX-NE-CONVERT): plain F.linear then computes the same products.
    """
    # NOTE: (module, name) pairs, not the children: a list holding every nn.Linear would keep
    # every unpacked weight alive until the end (the loading peak: packed + unpacked weights).
    linears = [
        (module, name)
        for module in model.modules()
        for name, child in module.named_children()
        if isinstance(child, nn.Linear) and worth_packing(child.weight)
    ]
    for i, (module, name) in enumerate(linears):  # one at a time: each unpacked weight freed
        try:
            setattr(module, name, PackedLinear(getattr(module, name)))
        except RuntimeError:
            if i:
                raise
            return False
    for module in list(model.modules()):
        pack = getattr(module, "pack_for_cpu", None)
        if pack is not None:
            pack()
    return True
