"""Loader of quant_linear.cu: the CUDA products of a weight kept in groups of 32 inputs.

The functions take what the CPU kernels (engine/worker/models/layers/cpu_quant.cpp) take, so a
GroupedLinear uses either through one hook (`use_kernel`): `q4_linear(x, qs, scale, zero)`,
`q8_linear(x, qs, scale)` for up to GEMV_ROWS rows (decode), and `q4_dequant(qs, scale, zero,
dtype)`, `q8_dequant(qs, scale, dtype)` that expand the weight for a dense product (prefill).
Scales are float32, or float16 (a GGUF file's own pair, exact), one a group of 32 inputs or
(8-bit) one every 16 (GGUF's Q6_K); activations float32, bfloat16 or float16.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from cuda.cupy_launch import DTYPE_NAMES, DTYPES, check, check_cuda, launch, ptr

CU_FILE = "quant_linear.cu"
GROUP = 32
GEMV_ROWS = 8
"""Rows up to which a GroupedLinear multiplies on its groups here (quant_linear.cu's
GEMV_MAX_ROWS); more rows expand the weight and take cuBLAS's dense product."""
GEMV_WARPS = 4
DEQUANT_THREADS = 256
SCALE_NAMES: dict[torch.dtype, str] = {torch.float32: "float", torch.float16: "deja::f16"}
"""C++ type of a group's scale (and zero) for each kept dtype."""
KINDS = ("q4", "q8")


def kernel_name(kind: str, op: str, dtype: torch.dtype, scale_dtype: torch.dtype) -> str:
    return f"deja::{kind}_{op}_kernel<{DTYPE_NAMES[dtype]}, {SCALE_NAMES[scale_dtype]}>"


def instantiations() -> list[str]:
    """Every name expression this loader may compile (the CI compile check builds them all)."""
    return [
        kernel_name(kind, op, t, s)
        for kind in KINDS
        for op in ("gemv", "dequant")
        for t in DTYPES
        for s in SCALE_NAMES
    ]


def _weight(
    kind: str, qs: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> tuple[int, int, tuple[Any, ...], dict[str, torch.Tensor]]:
    """(out_features, in_features, the weight's kernel arguments, its tensors by name for the
    device check) of a kept weight; ValueError on a layout the kernels do not take
    (cpu_quant.cpp's deja_cpu::check_weight, the same rules). The arguments end with zero's
    pointer for 4-bit, the scales a group (1, or 2: every 16 inputs) for 8-bit."""
    check(
        qs.dim() == 2 and qs.dtype == (torch.uint8 if kind == "q4" else torch.int8),
        lambda: (
            f"{kind} qs must be 2-D {'uint8' if kind == 'q4' else 'int8'}, got "
            f"{tuple(qs.shape)} {qs.dtype}"
        ),
    )
    n = int(qs.shape[0])
    k = int(qs.shape[1]) * (2 if kind == "q4" else 1)
    check(k % GROUP == 0, lambda: f"in_features must be a multiple of {GROUP}, got {k}")
    sub = 2 if kind == "q8" and scale.dim() == 2 and scale.shape[1] * GROUP == 2 * k else 1
    for name, t in (("scale", scale), ("zero", zero)):
        if t is not None:
            _check_groups(name, t, scale.dtype, n, k // GROUP * sub)
    tensors = [qs, scale] + ([] if zero is None else [zero])
    check(all(t.is_contiguous() for t in tensors), lambda: "qs, scale and zero must be contiguous")
    check(qs.data_ptr() % 16 == 0, lambda: "qs must be 16-byte aligned")
    last = np.int32(sub) if zero is None else ptr(zero)
    named = {"qs": qs, "scale": scale, **({} if zero is None else {"zero": zero})}
    return n, k, (ptr(qs), ptr(scale), last), named


def _check_groups(name: str, t: torch.Tensor, dtype: torch.dtype, n: int, groups: int) -> None:
    check(
        t.shape == (n, groups) and t.dtype == dtype and t.dtype in SCALE_NAMES,
        lambda: (
            f"{name} must be [{n}, {groups}] float32 or float16 like scale, got "
            f"{tuple(t.shape)} {t.dtype}"
        ),
    )


def _linear(
    kind: str,
    x: torch.Tensor,
    qs: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None = None,
) -> torch.Tensor:
    n, k, weight, named = _weight(kind, qs, scale, zero)
    check(
        x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1 and x.dtype in DTYPE_NAMES,
        lambda: (
            f"x must be [rows, {k}] of {DTYPES} dense in the last dim, got "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
        ),
    )
    rows = int(x.shape[0])
    check(rows <= GEMV_ROWS, lambda: f"{kind}_linear takes up to {GEMV_ROWS} rows, got {rows}")
    device = check_cuda(x=x, **named)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        launch(
            CU_FILE,
            kernel_name(kind, "gemv", x.dtype, scale.dtype),
            device,
            grid=((n + GEMV_WARPS - 1) // GEMV_WARPS, 1, 1),
            block=(GEMV_WARPS * 32, 1, 1),
            args=(
                *(ptr(out), ptr(x), *weight),
                *(np.int32(rows), np.int32(n), np.int32(k), np.int64(x.stride(0))),
            ),
        )
    return out


def _dequant(
    kind: str, qs: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    n, k, weight, named = _weight(kind, qs, scale, zero)
    check(dtype in DTYPE_NAMES, lambda: f"dtype must be one of {DTYPES}, got {dtype}")
    device = check_cuda(**named)
    out = torch.empty((n, k), dtype=dtype, device=qs.device)
    groups = n * (k // GROUP)
    if groups:
        launch(
            CU_FILE,
            kernel_name(kind, "dequant", dtype, scale.dtype),
            device,
            grid=((groups + DEQUANT_THREADS - 1) // DEQUANT_THREADS, 1, 1),
            block=(DEQUANT_THREADS, 1, 1),
            args=(ptr(out), *weight, np.int64(groups)),
        )
    return out


q4_linear = functools.partial(_linear, "q4")
"""q4_linear(x, qs, scale, zero): x [rows <= GEMV_ROWS, K] times a 4-bit weight's transpose,
[rows, N] in x's dtype."""
q8_linear = functools.partial(_linear, "q8")
"""q8_linear(x, qs, scale): the same for an 8-bit weight."""


def q4_dequant(
    qs: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The 4-bit weight expanded: [N, K] of dtype (cpu_quant.cpp's q4_dequant's bits)."""
    return _dequant("q4", qs, scale, zero, dtype)


def q8_dequant(qs: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 8-bit weight expanded: [N, K] of dtype."""
    return _dequant("q8", qs, scale, None, dtype)
