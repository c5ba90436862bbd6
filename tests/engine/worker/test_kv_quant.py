"""fp8 KV storage: the codec, the torch backend on an fp8 cache, the scales, the refusals."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.config import CacheConfig
from engine.worker.attention import TorchAttentionBackend
from engine.worker.attention.kv_quant import (
    FP8_DTYPE,
    FP8_MAX,
    KVScales,
    dequantize_fp8,
    is_kv_scale_name,
    kv_storage_dtype,
    pow2_scale,
    quantize_fp8,
)
from engine.worker.kv_calibration import checkpoint_kv_scales
from tests.support.attention import make_attention_metadata

torch.set_num_threads(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_exact_for_every_finite_code(dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)  # every e4m3 bit pattern
    finite = ~codes.float().isnan()
    for scale in (1.0, 2.0**-7, 8.0):
        got = dequantize_fp8(codes, dtype, scale)
        assert got.dtype == dtype
        expected = (codes.float() * scale).to(dtype)
        assert torch.equal(got[finite], expected[finite]), (dtype, scale)


def test_quantize_saturates_rounds_to_nearest_and_round_trips_with_pow2_scales() -> None:
    x = torch.tensor([0.0, 1.0, -3.3, 1000.0, -1e9, 0.07, 17.0])
    q = quantize_fp8(x, 0.5)
    assert q.dtype == FP8_DTYPE
    back = dequantize_fp8(q, torch.float32, 0.5)
    assert back[3] == FP8_MAX * 0.5 and back[4] == -FP8_MAX * 0.5  # saturated, never NaN
    assert not back.isnan().any()
    # within e4m3's half-ulp (relative 2^-4) for the values in range
    inside = torch.tensor([0, 1, 2, 5, 6])
    err = (back[inside] - x[inside]).abs()
    assert (err <= x[inside].abs() * 2.0**-4 + 2.0**-10).all()
    # values on the fp8 grid times a power-of-two scale survive exactly
    grid = dequantize_fp8(torch.arange(0, 126, dtype=torch.uint8).view(FP8_DTYPE), torch.float32, 1)
    assert torch.equal(dequantize_fp8(quantize_fp8(grid * 4.0, 4.0), torch.float32, 4.0), grid * 4)


def test_pow2_scale_covers_the_margin() -> None:
    for amax in (1e-3, 0.3, 1.0, 27.9, 448.0, 5000.0):
        s = pow2_scale(amax)
        assert math.log2(s) == round(math.log2(s))
        assert amax * 2.0 / s <= FP8_MAX < amax * 2.0 / s * 2  # the smallest such power of 2
    assert pow2_scale(0.0) == 1.0 and pow2_scale(float("nan")) == 1.0


def test_kv_storage_dtype_and_config_refuse_unknown_values() -> None:
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8_e4m3", torch.float32) == FP8_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="positive"):
        KVScales((1.0, 0.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="one K and one V"):
        KVScales((1.0,), (1.0, 1.0))


def _mixed_step(
    cache: torch.Tensor, scales: KVScales | None, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """One step on layer 1 of cache: two prefill chunks (one over cached context), two decodes."""
    rng = random.Random(0)
    bs = cache.shape[3]
    context, query = [5, 0, 17, 30], [7, 12, 1, 1]
    ids = list(range(cache.shape[2]))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in (c + n for c, n in zip(context, query, strict=True)):
        tables.append(ids[at : at + -(-n // bs)])
        at += len(tables[-1])
    meta, _ = make_attention_metadata(context, query, tables, bs)
    backend = TorchAttentionBackend()
    backend.bind_kv_cache(cache, scales)
    backend.prepare(meta)
    return backend.forward(q, k, v, cache[1], meta, q.shape[2] ** -0.5)


def test_fp8_cache_attends_like_a_float_cache_of_the_same_values() -> None:
    shape = (3, 2, 24, 4, 2, 16)  # [layers, 2, blocks, block_size, Hkv, D]
    gen = torch.Generator().manual_seed(0)
    scales = KVScales((1.0, 2.0**-4, 1.0), (1.0, 2.0**-5, 1.0))
    history = torch.randn(shape, generator=gen) * 2  # the cached context
    fp8 = torch.zeros(shape, dtype=FP8_DTYPE)
    fp8[:, 0] = quantize_fp8(history[:, 0], scales.k[1])
    fp8[:, 1] = quantize_fp8(history[:, 1], scales.v[1])
    t = 7 + 12 + 1 + 1
    q = torch.randn(t, 6, 16, generator=gen)
    k = torch.randn(t, 2, 16, generator=gen) * 3
    v = torch.randn(t, 2, 16, generator=gen)
    # The float run sees exactly the values the fp8 cache decodes to: the history and the new
    # K/V rounded to the fp8 grid (with power-of-two scales a second rounding changes nothing).
    k8 = dequantize_fp8(quantize_fp8(k, scales.k[1]), torch.float32, scales.k[1])
    v8 = dequantize_fp8(quantize_fp8(v, scales.v[1]), torch.float32, scales.v[1])
    floats = torch.empty(shape)
    floats[:, 0] = dequantize_fp8(fp8[:, 0], torch.float32, scales.k[1])
    floats[:, 1] = dequantize_fp8(fp8[:, 1], torch.float32, scales.v[1])
    out8 = _mixed_step(fp8, scales, k, v, q)
    out32 = _mixed_step(floats, None, k8, v8, q)
    torch.testing.assert_close(out8, out32, rtol=1e-6, atol=1e-6)
    assert fp8.dtype == FP8_DTYPE
    decoded = dequantize_fp8(fp8[1], torch.float32, 1.0)
    decoded[0] *= scales.k[1]
    decoded[1] *= scales.v[1]
    assert torch.equal(decoded, floats[1])  # the writes landed in the same slots, same values
    # Unquantized K/V on a float cache of the unquantized history differ only by fp8 rounding.
    exact = _mixed_step(history.clone(), None, k, v, q)
    assert 0 < (out8 - exact).abs().max() < 0.5


def test_an_fp8_cache_needs_its_scales() -> None:
    cache = torch.zeros((2, 2, 4, 4, 1, 8), dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="needs K and V scales for each layer"):
        TorchAttentionBackend().bind_kv_cache(cache, None)
    with pytest.raises(ValueError, match="needs K and V scales for each layer"):
        TorchAttentionBackend().bind_kv_cache(cache, KVScales((1.0,), (1.0,)))
    backend = TorchAttentionBackend()
    with pytest.raises(ValueError, match="without scales"):
        backend.layer_scales(cache[0])


def test_checkpoint_scales_are_read_and_not_loaded_as_weights(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    assert is_kv_scale_name("model.layers.3.self_attn.k_scale")
    assert is_kv_scale_name("model.layers.0.self_attn.attn.v_scale")
    assert not is_kv_scale_name("model.layers.0.self_attn.k_proj.weight")
    tensors = {
        f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(0.5 + i)
        for i in range(2)
        for kv in "kv"
    }
    tensors["model.embed_tokens.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    found = checkpoint_kv_scales([tmp_path / "model.safetensors"], 2)
    assert found == KVScales((0.5, 1.5), (0.5, 1.5), source="checkpoint")
    with pytest.raises(ValueError, match="incomplete"):
        checkpoint_kv_scales([tmp_path / "model.safetensors"], 3)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "none.safetensors"))
    assert checkpoint_kv_scales([tmp_path / "none.safetensors"], 2) is None


def test_engine_sizes_fp8_blocks_by_their_bytes_and_calibrates(tiny_llama_path: Path) -> None:
    budget = {"device_memory_gib": 0.01, "num_cpu_blocks": 0}
    f32 = LLM(str(tiny_llama_path), dtype="float32", **budget).engine
    f8 = LLM(str(tiny_llama_path), dtype="float32", kv_cache_dtype="fp8_e4m3", **budget).engine
    assert f8.core.block_bytes * 4 == f32.core.block_bytes
    n8, n32 = f8.model_info.num_device_blocks, f32.model_info.num_device_blocks
    assert 4 * n32 <= n8 < 4 * (n32 + 1)  # the same budget, floor-divided by a quarter the bytes
    assert f8.core.runner.kv_cache.dtype == FP8_DTYPE and f8.model_info.kv_cache_dtype == "fp8_e4m3"
    scales = f8.core.kv_scales
    assert scales is not None and scales.source == "calibrated"
    assert scales.num_layers == f8.model_info.num_layers
    for s in (*scales.k, *scales.v):
        assert math.log2(s) == round(math.log2(s))
    again = LLM(str(tiny_llama_path), dtype="float32", kv_cache_dtype="fp8_e4m3", **budget)
    assert again.engine.core.kv_scales == scales  # deterministic: same model, same scales


def test_fp8_with_a_backend_that_cannot_is_refused(tiny_llama_path: Path) -> None:
    from engine.worker.kv_calibration import kv_cache_storage

    class NoFp8(TorchAttentionBackend):
        name = "nofp8"
        supports_fp8_kv = False

    with pytest.raises(ValueError, match="not supported by the 'nofp8' attention backend"):
        kv_cache_storage("fp8_e4m3", torch.float32, NoFp8())
    assert kv_cache_storage("auto", torch.float32, NoFp8()) == torch.float32
