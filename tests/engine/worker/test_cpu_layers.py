"""The C++ layer kernels (cpu_layers.cpp: RMSNorm, fused add + RMSNorm, RoPE) against the
torch ops they replace.

Skips, with the reason, where the kernels cannot be built (no compiler): the engine then keeps
torch's ops.
"""

from __future__ import annotations

import pytest
import torch

from engine.worker.attention.cpu_kernel import load_kernel
from engine.worker.models.layers.norm import RMSNorm
from engine.worker.models.layers.rotary import apply_rope

KERNEL = load_kernel()
pytestmark = pytest.mark.skipif(
    KERNEL.ops is None, reason=f"CPU kernels not built: {KERNEL.reason}"
)


def _norms(hidden: int, dtype: torch.dtype) -> tuple[RMSNorm, RMSNorm]:
    """(torch ops, C++ kernel) with the same random weight."""
    ref, fused = RMSNorm(hidden, 1e-5, dtype), RMSNorm(hidden, 1e-5, dtype)
    with torch.no_grad():
        ref.weight.normal_(1.0, 0.3)
        fused.weight.copy_(ref.weight)
    fused.use_kernel(KERNEL.ops)
    assert fused.kernel is not None and ref.kernel is None
    return ref, fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (7, 576), (300, 96), (2048, 64)])
def test_rms_norm_and_fused_add_match_torch(dtype: torch.dtype, rows: int, hidden: int) -> None:
    torch.manual_seed(rows)
    ref, fused = _norms(hidden, dtype)
    x = (torch.randn(rows, hidden) * 3).to(dtype)
    h = torch.randn(rows, hidden).to(dtype)
    # float32: the sum of squares in another order (last-bit differences); bf16: the same value
    # before the final rounding, so at most one bf16 step apart
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (0.0, 8e-3)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), ref(x), atol=atol, rtol=rtol)
        summed, normed = fused.add_norm(x, h)
        assert torch.equal(summed, x + h)  # the residual sum rounds as torch's add does
        torch.testing.assert_close(normed, ref(x + h), atol=atol, rtol=rtol)
        assert not torch.equal(summed, x)  # the inputs were not modified in place
    if dtype == torch.bfloat16:
        close = (fused(x) == ref(x)).float().mean().item()
        assert close > 0.99, f"only {close:.1%} of bf16 values identical"


def test_per_head_norm_on_3d_rows() -> None:
    """QK norm: a [T, heads, head_dim] input with a [head_dim] weight, normed per head."""
    torch.manual_seed(0)
    ref, fused = _norms(16, torch.float32)
    q = torch.randn(5, 4, 16)
    with torch.no_grad():
        torch.testing.assert_close(fused(q), ref(q), atol=1e-5, rtol=1e-5)


def test_non_contiguous_or_other_dtype_input_takes_torch_ops() -> None:
    torch.manual_seed(0)
    ref, fused = _norms(32, torch.float32)
    x = torch.randn(32, 8).t()  # [8, 32], strided rows
    assert not x.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), ref(x))
        summed, normed = fused.add_norm(x, torch.ones(8, 32))
        torch.testing.assert_close(summed, x + 1)
        torch.testing.assert_close(normed, ref(x + 1))
    half = RMSNorm(32, 1e-5, torch.float16)
    half.use_kernel(KERNEL.ops)
    assert half.kernel is None  # the kernels take float32 and bfloat16 only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim", "rotary"), [(2, 6, 64, 64), (37, 3, 96, 32)]
)
def test_rope_gives_apply_ropes_bits(
    dtype: torch.dtype, tokens: int, heads: int, head_dim: int, rotary: int
) -> None:
    """Bit for bit what apply_rope's torch ops give (each product and sum rounded as torch rounds
    them), on a strided [T, H, D] view as the attention passes it (q and k heads of the fused
    qkv output), with full and partial rotary dims."""
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2) * head_dim).to(dtype)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # rows strided by (H + 2) * D
    assert not x.is_contiguous()
    angles = torch.randn(tokens, rotary) * 3
    cos_sin = torch.cat((angles[:, : rotary // 2].cos(), angles[:, : rotary // 2].sin()), -1)
    cos_sin = cos_sin.to(dtype)
    cos, sin = cos_sin[:, None, : rotary // 2], cos_sin[:, None, rotary // 2 :]
    got = KERNEL.ops.rope(x, cos, sin)  # type: ignore[union-attr]
    assert got.is_contiguous() and got.dtype == dtype
    assert torch.equal(got, apply_rope(x, cos, sin))
