"""RMSNorm as transformers computes it: Llama's (scale after the cast back) and Gemma's
(`1 + w`, scaled in float32 before the cast)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps), normalized in float32, cast back, then * weight.

    On the CPU, `use_kernel` hands it the C++ kernels (cpu_layers.cpp): one call instead of
    torch's composite of small ops, and `add_norm` fuses the residual add before it.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.kernel: Any = None
        """torch.ops.deja_cpu_attn (rms_norm, add_rms_norm), or None: torch ops."""

    def use_kernel(self, ops: Any) -> None:
        """Computes with the CPU kernels from now on (float32 and bfloat16 weights only)."""
        if self.weight.dtype in (torch.float32, torch.bfloat16) and self.weight.is_contiguous():
            self.kernel = ops

    def add_norm(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, norm(x + h)); x, h: [T, hidden]."""
        if self._kernel_takes(x) and h.is_contiguous() and h.dtype == x.dtype:
            out: tuple[torch.Tensor, torch.Tensor] = self.kernel.add_rms_norm(
                x, h, self.weight, self.eps
            )
            return out
        x = x + h
        return x, self(x)

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        return self.kernel is not None and x.dtype == self.weight.dtype and x.is_contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden], or [T, heads, head_dim] (QK norm over each head) -> x's shape."""
        if self._kernel_takes(x):
            # NOTE: the kernels take 2D rows; contiguous heads are rows of head_dim (a one-token
            # step's q / k split from qkv is contiguous, a longer step's is not: torch ops)
            rows = x.reshape(-1, x.shape[-1])
            out: torch.Tensor = self.kernel.rms_norm(rows, self.weight, self.eps)
            return out.view(x.shape)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op: the same x * rsqrt(mean(x^2) + eps) * weight, bit for bit (the
            # parity tests hold it to transformers), without the eight small ops below.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores w with the norm scaling by (1 + w); normalized and
    scaled in float32, then cast back (transformers' Gemma2/Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.eps = eps

    def add_norm(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, norm(x + h)), as RMSNorm.add_norm."""
        x = x + h
        return x, self(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


NormClass = type[RMSNorm] | type[GemmaRMSNorm]
