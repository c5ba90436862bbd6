"""The CUDA kernels on an fp8 (float8_e4m3fn) KV cache, run on the CPU through the real loaders.

reshape_and_cache must quantize bit for bit as torch does (engine/worker/attention/kv_quant.py:
x / scale, round to nearest even, saturate to +-448); the decode and prefill kernels must attend
over the dequantized cache (K scale folded into the softmax scale, V scale on the output) within
the same tolerance as over a cache in the activations' dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

from cuda import block_copy, paged_attention, prefill_attention, reshape_and_cache
from engine.worker.attention.kv_quant import FP8_DTYPE, dequantize_fp8, quantize_fp8
from tests.cuda_emu.emulator import Emulator
from tests.support import kernel_reference as kref

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

CONFIGS = kref.ATTN_CONFIGS[:4]
K_SCALE, V_SCALE = 2.0**-5, 2.0**-6


def _names() -> list[str]:
    names = [reshape_and_cache.fp8_kernel_name(t) for t in (BF16, F16, F32)]
    names += block_copy.instantiations()
    return names + kref.attention_kernel_names(CONFIGS, FP8_DTYPE)


@pytest.fixture(scope="module")
def emulator() -> Emulator:
    return Emulator(_names())


def _fp8_cache(case: kref.PagedCase) -> torch.Tensor:
    """The case's cache after the new tokens' writes, quantized as the torch backend does."""
    full = kref.write_reference(case)
    cache = torch.empty(full.shape, dtype=FP8_DTYPE)
    cache[0] = quantize_fp8(full[0], K_SCALE)
    cache[1] = quantize_fp8(full[1], V_SCALE)
    return cache


def _dequantized(cache: torch.Tensor) -> torch.Tensor:
    out = torch.empty(cache.shape, dtype=torch.float64)
    out[0] = dequantize_fp8(cache[0], F32, K_SCALE).double()
    out[1] = dequantize_fp8(cache[1], F32, V_SCALE).double()
    return out


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("scales", [(K_SCALE, V_SCALE), (0.3, 3.7)])
def test_reshape_and_cache_quantizes_like_torch(
    emu: Emulator, dtype: torch.dtype, scales: tuple[float, float]
) -> None:
    hq, hkv, d = 4, 2, 64
    case = kref.make_case([3, 0, 20], [2, 5, 1], hq, hkv, d, 16, dtype, num_padding_tokens=2)
    t = case.q.shape[0]
    # magnitudes from subnormal to saturated, and every e4m3 value exactly on the grid
    spread = torch.logspace(-4, 3.5, t * hkv * d).view(t, hkv, d)
    grid = dequantize_fp8(torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE), F32, 1.0)
    grid = grid.nan_to_num(0.0).repeat(t * hkv * d // 256 + 1)[: t * hkv * d].view(t, hkv, d)
    k = (case.k.float() * spread).to(dtype)
    v = (grid * scales[1]).to(dtype)
    cache = torch.zeros(case.kv_cache.shape, dtype=FP8_DTYPE)
    reshape_and_cache.reshape_and_cache(k, v, cache, case.slot_mapping, *scales)
    keep = case.slot_mapping >= 0
    flat = cache.view(2, -1, hkv, d)
    for half, x, s in ((0, k, scales[0]), (1, v, scales[1])):
        expected = quantize_fp8(x[keep], s).view(torch.uint8)
        assert torch.equal(flat[half, case.slot_mapping[keep]].view(torch.uint8), expected)
    written = torch.zeros(flat.shape[1], dtype=torch.bool)
    written[case.slot_mapping[keep]] = True
    assert (flat[:, ~written].view(torch.uint8) == 0).all()  # nothing else touched
    assert [n for n, _, _ in emu.launches] == [reshape_and_cache.fp8_kernel_name(dtype)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=kref.config_id)
def test_decode_reads_fp8(emu: Emulator, cfg: kref.AttnConfig) -> None:
    dtype, d, bs, hq, hkv = cfg
    case = kref.make_case([0, 16, 70, 31], [1, 1, 1, 1], hq, hkv, d, bs, dtype, seed=1)
    cache = _fp8_cache(case)
    scale = 1 / math.sqrt(d)
    for split in (False, True):
        out = torch.full_like(case.q, float("nan"))
        paged_attention.paged_decode_attention(
            out,
            case.q,
            cache,
            case.block_tables,
            case.seq_lens,
            scale,
            case.max_seq_len,
            split=split,
            kv_scales=(K_SCALE, V_SCALE),
        )
        kref.assert_matches_reference(out, case, _dequantized(cache), scale, context=split)
    heads = paged_attention.heads_per_cta(hq // hkv)
    assert emu.launches[0][0] == paged_attention.decode_kernel_name(dtype, d, bs, heads, FP8_DTYPE)


@pytest.mark.parametrize("cfg", CONFIGS, ids=kref.config_id)
def test_prefill_reads_fp8(emu: Emulator, cfg: kref.AttnConfig) -> None:
    dtype, d, bs, hq, hkv = cfg
    case = kref.make_case(
        [0, 21, 40, 3], [19, 12, 1, 40], hq, hkv, d, bs, dtype, num_padding_tokens=3, seed=4
    )
    cache = _fp8_cache(case)
    scale = 1 / math.sqrt(d)
    out = torch.full_like(case.q, float("nan"))
    prefill_attention.paged_prefill_attention(
        out,
        case.q,
        cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        scale,
        case.max_query_len,
        kv_scales=(K_SCALE, V_SCALE),
    )
    kref.assert_matches_reference(out, case, _dequantized(cache), scale)
    n = case.num_queries
    assert out[n:].isnan().all()
    assert [x for x, _, _ in emu.launches] == [
        prefill_attention.kernel_name(dtype, d, bs, FP8_DTYPE)
    ]


def test_loaders_refuse_an_fp8_cache_with_mismatched_activations(emu: Emulator) -> None:
    case = kref.make_case([0], [4], 2, 2, 64, 16, BF16)
    cache = torch.zeros(case.kv_cache.shape, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="dtypes differ"):
        reshape_and_cache.reshape_and_cache(case.k, case.v.float(), cache, case.slot_mapping)
    with pytest.raises(ValueError, match="scales must be positive"):
        reshape_and_cache.reshape_and_cache(case.k, case.v, cache, case.slot_mapping, 0.0, 1.0)


def test_block_copies_move_fp8_blocks(emu: Emulator) -> None:
    cache = torch.randn(3, 2, 10, 16, 2, 64).clamp(-400, 400).to(FP8_DTYPE)
    src = torch.tensor([0, 4, 5], dtype=torch.int64)
    dst = torch.tensor([2, 1, 3], dtype=torch.int64)
    expected = cache.view(torch.uint8).clone()
    expected[:, :, dst] = expected[:, :, src]
    block_copy.copy_blocks(cache, src, dst)
    assert torch.equal(cache.view(torch.uint8), expected)
    staging = torch.empty(3, 2, 3, 16, 2, 64, dtype=FP8_DTYPE)
    block_copy.gather_blocks(cache, src, staging)
    assert torch.equal(staging.view(torch.uint8), cache.view(torch.uint8)[:, :, src])
