"""Rotary position embeddings: the inverse frequencies of every rope_type a supported
checkpoint uses (default, linear, llama3, yarn, longrope), full or partial rotary, per-layer-type
settings (Gemma 3's local and global bases), and a cos/sin cache indexed by position.

Frequencies are computed exactly as transformers' ROPE_INIT_FUNCTIONS compute them, in float32;
cos/sin are scaled by the rope's attention factor in float32 and cast to the model dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(cfg: Any, layer_type: str | None = None) -> dict[str, Any]:
    """RoPE settings from either config style, as one flat dict with rope_type and rope_theta.

    transformers 5 writes `rope_parameters` {rope_theta, rope_type, factor, ...}, per layer type
    for Gemma 3 ({"sliding_attention": {...}, "full_attention": {...}}); older checkpoints write
    `rope_theta` plus an optional `rope_scaling` dict ({type|rope_type, factor, ...}).
    """
    params: dict[str, Any] = {}
    scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(scaling, dict):
        params.update(scaling)
    new_style = getattr(cfg, "rope_parameters", None)
    if isinstance(new_style, dict):
        if layer_type is not None and isinstance(new_style.get(layer_type), dict):
            new_style = new_style[layer_type]
        params.update(new_style)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(cfg, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(cfg, "partial_rotary_factor", None) or 1.0
    needs_original = params["rope_type"] in ("llama3", "yarn", "longrope")
    if needs_original and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = (
            getattr(cfg, "original_max_position_embeddings", None) or cfg.max_position_embeddings
        )
    return params


def rotary_dim(cfg: Any, head_dim: int, layer_type: str | None = None) -> int:
    """How many leading dims of each head rotate (head_dim x partial_rotary_factor)."""
    return int(head_dim * rope_parameters(cfg, layer_type)["partial_rotary_factor"])


def rope_inv_freq(
    cfg: Any, head_dim: int | None = None, layer_type: str | None = None, long: bool = False
) -> tuple[torch.Tensor, float]:
    """([rotary_dim / 2] float32 inverse frequencies, attention scaling of cos/sin).

    `long`: LongRoPE's long factors (positions past original_max_position_embeddings).
    """
    params = rope_parameters(cfg, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: " + ", ".join(ROPE_TYPES)
        )
    if head_dim is None:
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    dim = int(head_dim * params["partial_rotary_factor"])
    base = params["rope_theta"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim / 2]
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    if rope_type == "yarn":
        return _yarn(cfg, params, base, dim)
    return _longrope(cfg, params, base, exponents, long)


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # wavelen < high_freq_wavelen: keep; wavelen > low_freq_wavelen: divide by factor;
    # in between: interpolate smoothly.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn(cfg: Any, params: dict[str, Any], base: float, dim: int) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or cfg.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # [dim / 2]
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(
    cfg: Any, params: dict[str, Any], base: float, exponents: torch.Tensor, long: bool
) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or cfg.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * base**exponents), float(attention_factor)


def _cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor) -> torch.Tensor:
    """[P, R] = [cos | sin] of positions x inv_freq, times `scale`, in float32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [P, R / 2]
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to max_position_embeddings for one rope setting.

    NOTE (LongRoPE): transformers switches the whole sequence to the long factors once it grows
    past original_max_position_embeddings (and recomputes its cache); here each position uses the
    factors of its own range (short below, long from original_max_position_embeddings on), so the
    cached keys of a growing sequence never change. Both agree on sequences within the original
    length.
    """

    def __init__(
        self, cfg: Any, head_dim: int, dtype: torch.dtype, layer_type: str | None = None
    ) -> None:
        super().__init__()
        params = rope_parameters(cfg, layer_type)
        self.rotary_dim = int(head_dim * params["partial_rotary_factor"])
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.int64)
        inv_freq, scale = rope_inv_freq(cfg, head_dim, layer_type)
        cache = _cos_sin(inv_freq, scale, positions)  # [P, R]
        if params["rope_type"] == "longrope":
            original = params["original_max_position_embeddings"]
            long_freq, _ = rope_inv_freq(cfg, head_dim, layer_type, long=True)
            cache[original:] = _cos_sin(long_freq, scale, positions[original:])
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", cache.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, 1, R / 2]."""
        half = self.rotary_dim // 2
        cos_sin = self.cos_sin_cache[positions]  # [T, R]
        return cos_sin[:, None, :half], cos_sin[:, None, half:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, R / 2] -> rotate-half RoPE on the first R dims of each head
    (R = D unless the rotary is partial), as transformers applies it."""
    half = cos.shape[-1]
    rot = 2 * half
    x1, x2 = x[..., :half], x[..., half:rot]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if rot == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., rot:]), dim=-1)
