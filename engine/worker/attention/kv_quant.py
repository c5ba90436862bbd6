"""fp8 (e4m3) KV storage: quantize on write, dequantize on read, one scale per layer for K and V.

A stored element is q = saturate(x / scale) in float8_e4m3fn (|q| <= 448, 3 mantissa bits); it
reads back as q * scale. Every layer has one scale for its K and one for its V (per tensor, as
vLLM's `k_scale` / `v_scale`), taken from, in this order: the checkpoint's `k_scale` / `v_scale`
tensors; the disk tier's manifest (the scales its blocks were written with, so a restarted replica
reads them back unchanged); or a calibration pass at start (engine/worker/kv_calibration.py).

NOTE: calibrated scales are powers of two. Then x / scale and q * scale are exact in every float
type, so the only error is e4m3's own rounding (relative 2^-4 at most), and dequantizing into
bfloat16 or float16 adds none.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude; quantized values are clamped to it."""
CALIBRATION_MARGIN = 2.0
"""Calibrated scale covers this many times the largest |K| or |V| seen while calibrating, so
later prompts with somewhat larger values do not saturate. It costs no precision (e4m3 keeps 3
mantissa bits across 2^-6..448); it only moves the subnormal threshold up by one binade."""


CHECKPOINT_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?([kv])_scale$")
"""Checkpoint names of per-layer KV scales (vLLM / llm-compressor fp8 checkpoints)."""


def is_kv_scale_name(name: str) -> bool:
    """A checkpoint tensor that is a KV-cache scale, not a weight (engine/worker/kv_calibration.py
    reads them)."""
    return CHECKPOINT_SCALE.search(name) is not None


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache tensors' dtype for CacheConfig.kv_cache_dtype ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_DTYPE
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose auto or fp8_e4m3")


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one KV block in every layer, K and V, stored as `dtype`: what the device pool,
    the CPU tier and the disk tier are sized by (fp8: half of bf16's, a quarter of float32's)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


@dataclass(frozen=True, slots=True)
class KVScales:
    """Per-layer dequantization scales of an fp8 KV cache: x ~= q * k[layer] (K), q * v[layer]."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str = "calibrated"
    """Where they came from: checkpoint, disk (a disk tier's manifest) or calibrated."""

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v) or not self.k:
            raise ValueError(f"KV scales need one K and one V scale per layer, got {self!r}")
        for s in (*self.k, *self.v):
            if not (math.isfinite(s) and s > 0):
                raise ValueError(f"KV scales must be finite and positive, got {s}")

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def to_json(self) -> dict[str, list[float]]:
        """The manifest's form (floats round-trip exactly through JSON)."""
        return {"k": list(self.k), "v": list(self.v)}

    @classmethod
    def from_json(cls, data: Any, source: str) -> KVScales:
        return cls(tuple(float(x) for x in data["k"]), tuple(float(x) for x in data["v"]), source)


def pow2_scale(amax: float, margin: float = CALIBRATION_MARGIN) -> float:
    """Smallest power of two s with amax * margin / s <= FP8_MAX (1.0 for an all-zero tensor)."""
    if not amax > 0 or not math.isfinite(amax):
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * margin / FP8_MAX))


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x: [..] float -> float8_e4m3fn [..] = saturate(x / scale), rounded to nearest even.

    NOTE: clamped before the cast: torch turns out-of-range values into NaN for e4m3fn on some
    paths (it has no infinity)."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# (integer type, left shift, mask of sign + exponent + mantissa bits, 2^(bias - 7)) that place
# e4m3's bits inside the target type's bit pattern; the result reads as value / 2^(bias - 7),
# subnormals included.
_BIT_LAYOUT: dict[torch.dtype, tuple[torch.dtype, int, int, float]] = {
    torch.bfloat16: (torch.int16, 4, -0x7810, 2.0**120),  # 0x87f0
    torch.float16: (torch.int16, 7, -0x4080, 2.0**8),  # 0xbf80
    torch.float32: (torch.int32, 20, -0x78100000, 2.0**120),  # 0x87f00000
}


def dequantize_fp8(q: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """q: float8_e4m3fn [..] -> dtype [..] = q * scale.

    NOTE: on the CPU, torch converts float8 element by element (~1.3 ms per 184k elements here);
    moving the bits into the target type with integer ops (sign-extended, shifted, masked) and
    one multiply is ~4x faster and exact for every finite e4m3 value.
    """
    if q.device.type != "cpu" or dtype not in _BIT_LAYOUT:
        return q.to(dtype) * scale
    int_type, shift, mask, unbias = _BIT_LAYOUT[dtype]
    bits = (q.view(torch.int8).to(int_type) << shift) & mask
    return bits.view(dtype).mul_(unbias * scale)
