"""Loader of layers.cu: RMSNorm (with the residual add fused), rotate-half RoPE and SiLU-and-mul,
one launch each instead of torch's composites of small kernels.

The functions take what the CPU kernels (engine/worker/models/layers/cpu_layers.cpp) take, so the
model's layers use either through one hook (`use_kernel`): `rms_norm(x, w, eps)`,
`add_rms_norm(x, h, w, eps) -> (x + h, rms_norm(x + h))`, `rope(x, cos, sin)` and
`silu_and_mul(gate_up)`. The checks are few on purpose (each layer calls them on every step);
the layers hand them only what they take (`takes`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cuda.cupy_launch import DTYPE_NAMES, DTYPES, check, check_cuda, launch, ptr

CU_FILE = "layers.cu"
THREADS = 256
OPS = ("rms_norm", "rope", "silu_and_mul")


def kernel_name(op: str, dtype: torch.dtype) -> str:
    return f"deja::{op}_kernel<{DTYPE_NAMES[dtype]}>"


def instantiations() -> list[str]:
    """Every name expression this loader may compile (the CI compile check builds them all)."""
    return [kernel_name(op, t) for op in OPS for t in DTYPES]


def takes(x: torch.Tensor) -> bool:
    """Whether the ops take x: a dtype the kernels are built for, rows dense in their last dim."""
    return x.dtype in DTYPE_NAMES and x.stride(-1) == 1


def _rows(name: str, x: torch.Tensor) -> int:
    """x: [N, hidden] with dense rows; returns hidden."""
    check(
        x.dim() == 2 and x.stride(1) == 1 and x.dtype in DTYPE_NAMES,
        lambda: (
            f"{name} must be [tokens, hidden] rows of {DTYPES} dense in the last dim, got "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
        ),
    )
    return int(x.shape[1])


def _launch_rows(op: str, dtype: torch.dtype, device: torch.device, rows: int, *args: Any) -> None:
    """Launches `op`'s kernel for `dtype` with `args`, one block of THREADS per row (nothing for
    no rows)."""
    if rows:
        launch(
            CU_FILE,
            kernel_name(op, dtype),
            device,
            grid=(int(rows), 1, 1),
            block=(THREADS, 1, 1),
            args=args,
        )


def _norm(
    x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    hidden = _rows("x", x)
    check(
        weight.shape == (hidden,) and weight.dtype == x.dtype and weight.is_contiguous(),
        lambda: f"weight must be [{hidden}] of {x.dtype}, got {tuple(weight.shape)} {weight.dtype}",
    )
    residual = None
    if h is not None:
        check(
            h.shape == x.shape and h.dtype == x.dtype and h.stride(1) == 1,
            lambda: f"h must match x {tuple(x.shape)} {x.dtype}, got {tuple(h.shape)} {h.dtype}",
        )
        residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    device = check_cuda(x=x, weight=weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rows(
        "rms_norm",
        x.dtype,
        device,
        x.shape[0],
        ptr(out),
        np.uint64(0) if residual is None else ptr(residual),
        ptr(x),
        np.uint64(0) if h is None else ptr(h),
        ptr(weight),
        np.int32(hidden),
        np.int64(x.stride(0)),
        np.int64(0 if h is None else h.stride(0)),
        np.float32(eps),
    )
    return residual, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, hidden] -> weight * T(x * rsqrt(mean(x^2) + eps)) (transformers' Llama RMSNorm)."""
    return _norm(x, None, weight, eps)[1]


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)) with the sum rounded to x's dtype first, as torch's add does."""
    residual, out = _norm(x, h, weight, eps)
    assert residual is not None
    return residual, out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, R / 2] -> rotate-half RoPE on the first R dims of each head
    (engine/worker/models/layers/rotary.py's apply_rope), a new contiguous tensor."""
    check(
        x.dim() == 3 and x.dtype in DTYPE_NAMES,
        lambda: f"x must be [tokens, heads, head_dim] of {DTYPES}, got {tuple(x.shape)} {x.dtype}",
    )
    num_tokens, num_heads, head_dim = x.shape
    half = int(cos.shape[-1])
    check(
        x.stride(2) == 1 and (num_heads == 1 or x.stride(1) == head_dim),
        lambda: f"x's heads must be dense, got strides {x.stride()}",
    )
    check(
        cos.shape == sin.shape == (num_tokens, 1, half)
        and cos.dtype == sin.dtype == x.dtype
        and cos.stride(2) == sin.stride(2) == 1
        and cos.stride(0) == sin.stride(0)
        and 2 * half <= head_dim,
        lambda: (
            f"cos and sin must be [{num_tokens}, 1, R/2] of {x.dtype} with R <= {head_dim}, dense "
            f"rows of one stride; got {tuple(cos.shape)} {cos.dtype} {cos.stride()}, "
            f"{tuple(sin.shape)} {sin.dtype} {sin.stride()}"
        ),
    )
    device = check_cuda(x=x, cos=cos, sin=sin)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rows(
        "rope",
        x.dtype,
        device,
        num_tokens,
        ptr(out),
        ptr(x),
        ptr(cos),
        ptr(sin),
        np.int32(num_heads),
        np.int32(head_dim),
        np.int32(half),
        np.int64(x.stride(0)),
        np.int64(cos.stride(0)),
    )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 I] ([gate | up] rows) -> silu(gate) * up: [T, I]."""
    width = _rows("gate_up", gate_up)
    check(width % 2 == 0, lambda: f"gate_up's width must be even, got {width}")
    inter = width // 2
    device = check_cuda(gate_up=gate_up)
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    _launch_rows(
        "silu_and_mul",
        gate_up.dtype,
        device,
        gate_up.shape[0],
        ptr(out),
        ptr(gate_up),
        np.int32(inter),
        np.int64(gate_up.stride(0)),
    )
    return out
