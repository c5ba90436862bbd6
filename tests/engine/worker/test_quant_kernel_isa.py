"""cpu_quant.cpp, cpu_quant_i8.cpp and cpu_quant_bf16.cpp built for each instruction set they
have a path for (this machine's, which may be AVX-512 with VNNI and AMX, then AVX2 and plain
C++): the few-row products against the dequantized weights, the int8-activation products against
the same integer arithmetic in numpy (with AVX-512 VNNI, many rows through the tiled product),
the bfloat16 slab products (AMX tiles, or vdpbf16ps: the AVX512-BF16 build without AMX) against
the expanded weight's (bit for bit through an identity), and the expansions to float32, bfloat16 and float16, with float32 or float16 group
scales (8-bit ones also a scale every 16 weights), in a process of their own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.worker.attention import cpu_kernel
from tests.support.isa_build import build_library, compiler, cpu_has

LAYERS = Path(cpu_kernel.__file__).parents[1] / "models" / "layers"
SOURCES = (LAYERS / "cpu_quant.cpp", LAYERS / "cpu_quant_i8.cpp", LAYERS / "cpu_quant_bf16.cpp")

CHECK = r"""
import sys, numpy as np, torch
torch.ops.load_library(sys.argv[1])
ops = torch.ops.deja_cpu_attn
rng = np.random.default_rng(0)
for n, k in [(40, 96), (72, 576), (24, 8224)]:  # (257 groups: a long row, odd and past 16s)
    q4 = rng.integers(0, 16, (n, k)).astype(np.uint8)
    packed = q4.reshape(n, k // 32, 2, 16)
    qs4 = torch.from_numpy(np.ascontiguousarray(packed[:, :, 0] | (packed[:, :, 1] << 4)).reshape(n, k // 2))
    q8 = torch.from_numpy(rng.integers(-128, 128, (n, k)).astype(np.int8))
    scale = torch.from_numpy(rng.random((n, k // 32)).astype(np.float32))
    zero = torch.from_numpy(rng.standard_normal((n, k // 32)).astype(np.float32))
    w4 = (torch.from_numpy(q4.astype(np.float32)) - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    w8 = q8.float() * scale.repeat_interleave(32, 1)
    torch.testing.assert_close(ops.q4_dequant(qs4, scale, zero, torch.float32), w4)
    torch.testing.assert_close(ops.q8_dequant(q8, scale, torch.float32), w8)
    for dtype in (torch.bfloat16, torch.float16):  # rounded as torch rounds float32
        want = ops.q4_dequant(qs4, scale, zero, torch.float32).to(dtype)
        assert torch.equal(ops.q4_dequant(qs4, scale, zero, dtype), want)
        assert torch.equal(ops.q8_dequant(q8, scale, dtype), ops.q8_dequant(q8, scale, torch.float32).to(dtype))
    def close(got, want, tol=1e-5):
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < tol, err
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(m, k)
        close(ops.q4_linear(x, qs4, scale, zero), x @ w4.T)
        close(ops.q8_linear(x, q8, scale), x @ w8.T)
        y = ops.q4_linear(x.bfloat16(), qs4, scale, zero)
        assert y.dtype == torch.bfloat16
        # float32 sums rounded to bfloat16 as torch rounds them (infinities too; NaN stays NaN,
        # whose bits torch's own conversions do not agree on)
        xs = x.bfloat16()
        xs[-1, 0] = float("nan") if m > 1 else 1e38
        got = ops.q4_linear(xs, qs4, scale, zero)
        want = ops.q4_linear(xs.float(), qs4, scale, zero).bfloat16()
        assert torch.equal(got.isnan(), want.isnan()) and bool(want.isinf().any()) == (m == 1)
        assert torch.equal(got.nan_to_num(0.0, 7.0, -7.0), want.nan_to_num(0.0, 7.0, -7.0))
        # float16 pairs (d, m): the same bits as float32 scale d and zero m + 8d
        d16, m16 = scale.half(), zero.half()
        s32, z32 = d16.float(), m16.float() + 8 * d16.float()
        for xx in (x, x.bfloat16()):
            assert torch.equal(ops.q4_linear(xx, qs4, d16, m16), ops.q4_linear(xx, qs4, s32, z32))
            assert torch.equal(ops.q8_linear(xx, q8, d16), ops.q8_linear(xx, q8, s32))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(ops.q4_dequant(qs4, d16, m16, dtype), ops.q4_dequant(qs4, s32, z32, dtype))
        assert torch.equal(ops.q8_dequant(q8, d16, dtype), ops.q8_dequant(q8, s32, dtype))
    # int8 activations: x = dx (xq + c) in groups of 32 over [min(x, 0), max(x, 0)]:
    # dx = range / 254, c = round(lo / dx) + 127, xq = round(x / dx) - c in -127..127
    g = k // 32
    def int8_product(x, qw, d, m):
        xf = x.float().numpy().reshape(len(x), g, 32)
        lo, hi = np.minimum(xf.min(-1), 0), np.maximum(xf.max(-1), 0)
        span = (hi - lo).astype(np.float32)
        with np.errstate(divide="ignore", over="ignore"):
            inv = (np.float32(254) / span).astype(np.float32)
        inv = np.where((span > 0) & np.isfinite(inv), inv, 0).astype(np.float32)
        c = np.where(inv > 0, np.rint(lo * inv) + 127, 0).astype(np.int64)
        xq = np.clip(np.rint(xf * inv[..., None]).astype(np.int64) - c[..., None], -127, 127)
        dx = np.where((inv > 0) | ~np.isfinite(span), span / np.float32(254), 0).astype(np.float64)
        qg = qw.reshape(n, g, 32).astype(np.int64)
        dot = np.einsum("agj,ngj->ang", xq, qg) + c[:, None, :] * qg.sum(-1)[None]
        y = (dot * d[None] * dx[:, None]).sum(-1)
        y += (m[None] * (dx * (xq.sum(-1) + 32 * c))[:, None]).sum(-1)
        return torch.from_numpy(y)
    s64, z64 = scale.double().numpy(), zero.double().numpy()
    # (from linear_i8_tile_rows() rows, 16 for 8-bit, AVX-512 VNNI takes tiles of 16 outputs,
    # 8 rows a pass: 40 and 72 outputs end in a partial tile, 37 rows in a partial pass)
    assert ops.linear_i8_tile_rows() == int(sys.argv[2]), ops.linear_i8_tile_rows()
    for m in (1, 2, 3, 4, 7, 8, 9, 16, 37):
        x = torch.randn(m, k)
        x[0, :32] = 0  # an all-zero group
        x[-1, 32:64] = x[-1, 32:64].abs() + 1  # one of a single sign, away from 0
        x[-1, 64:96] = -x[-1, 64:96].abs()
        x[-1, 96:128] *= 1e-38  # a range too small to divide by: taken as zeros
        close(ops.q4_linear_i8(x, qs4, scale, zero).double(), int8_product(x, q4, s64, z64 - 8 * s64))
        close(ops.q8_linear_i8(x, q8, scale).double(), int8_product(x, q8.numpy(), s64, 0 * s64))
        # float16 pairs (d, m): w = q d + m; float16 8-bit scales
        close(
            ops.q4_linear_i8(x, qs4, d16, m16).double(),
            int8_product(x, q4, d16.double().numpy(), m16.double().numpy()),
        )
        h64 = d16.double().numpy()
        close(ops.q8_linear_i8(x, q8, d16).double(), int8_product(x, q8.numpy(), h64, 0 * h64))
        # bfloat16 rows: the product of their float32 values, rounded to bfloat16
        xb = x.bfloat16()
        got = ops.q4_linear_i8(xb, qs4, scale, zero)
        assert got.dtype == torch.bfloat16
        close(got.double(), int8_product(xb.float(), q4, s64, z64 - 8 * s64), 1e-2)
        close(ops.q8_linear_i8(xb, q8, scale).double(), int8_product(xb.float(), q8.numpy(), s64, 0 * s64), 1e-2)
    # 8-bit with a scale every 16 weights (Q6_K): products, expansions, and the int8-activation
    # entry taking the float product
    s16 = torch.from_numpy(rng.random((n, k // 16)).astype(np.float32))
    w16 = q8.float() * s16.repeat_interleave(16, 1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(ops.q8_dequant(q8, s16, dtype), w16.to(dtype))
    h16 = s16.half()
    assert torch.equal(ops.q8_dequant(q8, h16, torch.float32), q8.float() * h16.float().repeat_interleave(16, 1))
    for m in (1, 2, 4, 5, 9):
        x = torch.randn(m, k)
        close(ops.q8_linear(x, q8, s16), x @ w16.T)
        assert torch.equal(ops.q8_linear(x, q8, h16), ops.q8_linear(x, q8, h16.float()))
        assert torch.equal(ops.q8_linear_i8(x, q8, s16), ops.q8_linear(x, q8, s16))
    # bfloat16 x in slabs (where built: AMX tiles, or vdpbf16ps): the expanded bfloat16 weight's
    # product, float32 sums rounded to bfloat16 (AMX: 17 and 33 rows end in partial tiles of
    # rows; vdpbf16ps: 9, 17 and 33 in a partial pass of 8; 40 and 72 outputs in a partial slab)
    slabs, amx = ops.linear_bf16_rows(), ops.linear_amx_rows()
    assert (slabs, amx) == (int(sys.argv[3]), int(sys.argv[4])), (slabs, amx)
    torch.manual_seed(0)
    for m in (1, 9, 16, 17, 33, 64) if slabs else ():
        x = torch.randn(m, 2 * k).bfloat16()[:, 1::2]  # (strided: the op copies it)
        for got, w in (
            (ops.q4_linear_bf16(x, qs4, scale, zero), ops.q4_dequant(qs4, scale, zero, torch.bfloat16)),
            (ops.q4_linear_bf16(x, qs4, d16, m16), ops.q4_dequant(qs4, d16, m16, torch.bfloat16)),
            (ops.q8_linear_bf16(x, q8, scale), ops.q8_dequant(q8, scale, torch.bfloat16)),
            (ops.q8_linear_bf16(x, q8, s16), ops.q8_dequant(q8, s16, torch.bfloat16)),
        ):
            want = x.float() @ w.float().T
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert ((got.float() - want).abs().max() / want.abs().max()).item() < 5e-3
            if m >= 16:  # (only float32 summation order differs: rarely a rounding)
                assert (got == want.bfloat16()).float().mean().item() > 0.99
    if slabs:  # x = I: the weight itself, each output one product: q4_dequant's bits exactly
        eye = torch.eye(k).bfloat16()
        assert torch.equal(ops.q4_linear_bf16(eye, qs4, d16, m16), ops.q4_dequant(qs4, d16, m16, torch.bfloat16).T)
        assert torch.equal(ops.q4_linear_bf16(eye, qs4, scale, zero), ops.q4_dequant(qs4, scale, zero, torch.bfloat16).T)
        assert torch.equal(ops.q8_linear_bf16(eye, q8, h16), ops.q8_dequant(q8, h16, torch.bfloat16).T)
        assert torch.equal(ops.q8_linear_bf16(eye, q8, d16), ops.q8_dequant(q8, d16, torch.bfloat16).T)
        assert ops.q8_linear_bf16(torch.randn(2, 3, k).bfloat16(), q8, scale).shape == (2, 3, n)
print("ok")
"""


@pytest.mark.parametrize(
    "march",
    ["native", "cooperlake", "haswell", "x86-64"],
    ids=["native", "avx512-bf16", "avx2", "plain"],
)
def test_each_instruction_set_path_matches_the_dequantized_weight(
    march: str, tmp_path: Path
) -> None:
    if march == "cooperlake" and not cpu_has("avx512_bf16", "avx512_vnni", "avx512bw"):
        pytest.skip("this CPU has no AVX512-BF16 (the slab product without AMX)")
    lib = build_library(SOURCES, march, tmp_path / "quant.so")
    wide = march == "cooperlake" or (march == "native" and cpu_has("avx512bw"))
    tiles = wide and cpu_has("avx512_vnni")  # int8 tiles: their row bound, or 0
    # the slab product's first row: 9 on AMX where this CPU and this compiler have it, 2 with
    # vdpbf16ps, else 0
    cxx = compiler()
    amx = (
        march == "native"
        and cxx is not None
        and cpu_has("amx_tile", "amx_bf16", "avx512_bf16")
        and _amx_compiler(cxx)
    )
    slabs = "9" if amx else "2" if wide and cpu_has("avx512_bf16") else "0"
    ran = subprocess.run(
        [sys.executable, "-c", CHECK, str(lib), "4" if tiles else "0", slabs, "9" if amx else "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stderr[-3000:]


def _amx_compiler(cxx: str) -> bool:
    """The compiler builds AMX for this CPU (GCC 11 and later with -march=native)."""
    out = subprocess.run(
        [cxx, "-march=native", "-dM", "-E", "-x", "c++", "/dev/null"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return "__AMX_BF16__" in out.stdout and "__AMX_TILE__" in out.stdout
