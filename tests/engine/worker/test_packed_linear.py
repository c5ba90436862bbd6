"""PackedLinear (oneDNN-packed CPU weights) computes what nn.Linear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.worker.models.layers.linear import (
    PackedLinear,
    bucket_rows,
    pack_linears,
    worth_packing,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias, dtype=dtype)
    try:
        packed = PackedLinear(linear)
    except RuntimeError as e:
        # oneDNN packs bf16 only with AVX-512 (bw/vl/dq) or AVX-NE-CONVERT; pack_linears then
        # leaves the model's layers as they are (tested in test_model.py).
        if dtype == torch.bfloat16 and "cpu support" in str(e):
            pytest.skip(f"this CPU cannot pack bf16 weights: {e}")
        raise
    # One row (decode), a few rows, many rows, a 3-D batch and a non-contiguous view.
    inputs = [
        torch.randn(1, 96, dtype=dtype),
        torch.randn(7, 96, dtype=dtype),
        torch.randn(300, 96, dtype=dtype),
        torch.randn(2, 5, 96, dtype=dtype),
        torch.randn(9, 200, dtype=dtype)[:, 50:146],
    ]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        for x in inputs:
            got = packed(x)
            assert got.shape == (*x.shape[:-1], 160)
            assert got.dtype == dtype
            torch.testing.assert_close(got, linear(x), atol=tol, rtol=tol)
    assert not list(packed.parameters()), "the packed weight must not be a Parameter"


def test_bucket_rows_bounds_shapes_and_waste() -> None:
    """Few distinct shapes (oneDNN caches a kernel per shape), little padding, never fewer rows."""
    buckets = [bucket_rows(m) for m in range(1, 4097)]
    assert buckets[:16] == list(range(1, 17))  # decode batches exact
    assert all(b >= m for m, b in zip(range(1, 4097), buckets, strict=True))
    assert all(b <= m * 1.125 for m, b in zip(range(1, 4097), buckets, strict=True))
    assert buckets == sorted(buckets)
    assert len(set(buckets)) <= 100


def test_pack_linears_leaves_small_float32_weights_plain() -> None:
    """A small float32 weight stays nn.Linear (F.linear's sgemm beats oneDNN's per-call cost);
    a large one is packed; both still compute what they computed before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 192), nn.Linear(192, 512))  # 12,288 / 98,304 elements
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = model(x)
        assert pack_linears(model)
        assert type(model[0]) is nn.Linear and not worth_packing(model[0].weight)
        assert isinstance(model[1], PackedLinear)
        torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    assert worth_packing(torch.empty(192, 64, dtype=torch.bfloat16))
