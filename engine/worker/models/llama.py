"""The Llama family: Llama 2/3 (incl. llama3 RoPE scaling), SmolLM2, TinyLlama, Mistral, Qwen2.

One forward over the whole flat batch of scheduled tokens; attention goes through the backend,
which owns the paged KV cache layout. Matches transformers' LlamaForCausalLM / Qwen2ForCausalLM
numerically (RMSNorm in float32, RoPE cos/sin computed in float32 and cast to the model dtype).
q/k/v and gate/up projections are fused; `load_weights` concatenates the checkpoint's pieces.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.attention.base import AttentionBackend, AttentionMetadata
from engine.worker.models.sliding_window import layer_windows

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Checkpoint entries that older transformers versions saved but that hold no weights."""


def _head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """RoPE settings from either config style, as one flat dict with rope_type and rope_theta.

    transformers 5 writes `rope_parameters` {rope_theta, rope_type, factor, ...}; older checkpoints
    write `rope_theta` plus an optional `rope_scaling` dict ({type|rope_type, factor, ...}).
    """
    params: dict[str, Any] = {}
    scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(scaling, dict):
        params.update(scaling)
    new_style = getattr(cfg, "rope_parameters", None)
    if isinstance(new_style, dict):
        params.update(new_style)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(cfg, "rope_theta", None) or 10000.0
    if params["rope_type"] == "llama3" and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = cfg.max_position_embeddings
    return params


def rope_inv_freq(cfg: Any) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, computed exactly as transformers does."""
    params = rope_parameters(cfg)
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    dim = _head_dim(cfg)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported for the Llama family")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, llama3")
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


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op: the same x * rsqrt(mean(x^2) + eps) * weight, bit for bit (the
            # parity tests hold it to transformers), without the eight small ops below.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # NOTE: like transformers: normalize in float32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, D/2] -> rotate-half RoPE, as transformers applies it."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> nn.Linear:
    # Uninitialized: every weight comes from the checkpoint.
    return torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype)


class PackedLinear(nn.Module):
    """nn.Linear for CPU inference: the weight reordered once, at load, into oneDNN's blocked
    layout, and applied with oneDNN's linear (the ops torch inductor's freezing pass emits).

    NOTE: F.linear on a plain [out, in] weight reorders it on every call in bfloat16, which made
    bf16 decoding slower than float32 here. Packed, the demo model's matrix-vector products run
    2-7x faster in bf16 (the 49152 x 576 LM head: 4.2 -> 0.6 ms at one row) and 1.5-3x in float32
    at 16+ rows; see README "CPU speed". oneDNN picks the bf16 units (avx512_bf16, AMX) where the
    CPU has them. The packed tensor is opaque (mkldnn layout): it is not a Parameter and is not in
    the state dict; load weights before packing.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()  # [out, in]
        self.weight_packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]; rows padded to a bucket (see bucket_rows), then cut back
        flat = x.reshape(-1, self.in_features)  # [M, in]
        rows = flat.shape[0]
        padded = bucket_rows(rows)
        if padded != rows:
            flat = F.pad(flat, (0, 0, 0, padded - rows))  # [bucket, in]
        out = torch.ops.mkldnn._linear_pointwise(
            flat, self.weight_packed, self.bias, "none", [], ""
        )  # [bucket, out]
        return out[:rows].view(*x.shape[:-1], self.out_features)


def bucket_rows(rows: int) -> int:
    """The row count a PackedLinear computes for `rows` input rows: exact up to 16, then rounded
    up to a step of 1/8 of the power of two below: at most 12.5% more rows, 8 shapes an octave.

    NOTE: oneDNN builds and caches one kernel (primitive, ~0.5 MB) per input shape, up to 1,024 of
    them: with every batch size its own shape, a serving process grew by ~1 GB (the soak test
    caught it). Buckets bound it to ~70 shapes per weight up to 2,048 rows (~35 MB of kernels per weight).
    """
    if rows <= 16:
        return rows
    step = (1 << (rows.bit_length() - 1)) // 8
    return -(-rows // step) * step


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: Any,
        dtype: torch.dtype,
        backend: AttentionBackend,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        """This layer's window (engine/worker/models/sliding_window.py); None: full attention."""
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(cfg)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = attention_bias or cfg.model_type == "qwen2"
        self.qkv_proj = _linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias, dtype)
        self.o_proj = _linear(self.q_size, cfg.hidden_size, attention_bias, dtype)
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 * Hkv) * D]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads side by side get one RoPE: [T, Hq + Hkv, D]
        qk = apply_rope(qk.view(num_tokens, self.num_heads + self.num_kv_heads, -1), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, Hq, D], [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        out = self.backend.forward(
            q, k, v, kv_cache, meta, self.scale, sliding_window=self.sliding_window
        )  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported; supported: silu")
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias, dtype)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: Any,
        dtype: torch.dtype,
        backend: AttentionBackend,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, dtype, backend, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.utils.skip_init(
            nn.Embedding, cfg.vocab_size, cfg.hidden_size, dtype=dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, dtype, backend, window) for window in layer_windows(cfg)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder over a flat batch with a paged KV cache."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.backend = backend
        self.head_dim = _head_dim(hf_config)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = LlamaModel(hf_config, dtype, backend)
        if self.tie_word_embeddings:
            self.lm_head = _linear(hf_config.hidden_size, hf_config.vocab_size, False, dtype)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = _linear(hf_config.hidden_size, hf_config.vocab_size, False, dtype)
        # cos_sin_cache: [max_positions, D] = [cos | sin] of position * inv_freq, computed in
        # float32 and cast to the model dtype (as transformers does per forward).
        inv_freq = rope_inv_freq(hf_config)  # [D / 2]
        positions = torch.arange(hf_config.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D / 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_cache: [num_layers, 2, NB, BS, Hkv, D].

        Returns the final-norm hidden states [T, hidden] of every token.
        """
        half = self.head_dim // 2
        cos_sin = self.cos_sin_cache[positions]  # [T, D]
        cos = cos_sin[:, None, :half]  # [T, 1, D / 2]
        sin = cos_sin[:, None, half:]  # [T, 1, D / 2]
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, kv_cache[i], meta)
        return self.model.norm(h)

    def use_cpu_layout(self) -> None:
        """Packs every projection for oneDNN (PackedLinear); call once, after loading, when the
        model runs on the CPU. A tied lm_head gets its own packed copy (the embedding keeps its
        rows): vocab x hidden more memory, for the largest product of every step."""
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, PackedLinear(child))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face checkpoint tensors (names as in transformers) into the fused layout.

        Raises ValueError on an unknown name, a shape mismatch or a weight missing at the end.
        """
        params = dict(self.named_parameters())
        pending = set(params)
        if self.tie_word_embeddings:
            pending.discard("lm_head.weight")
        cfg = self.config
        q_size = cfg.num_attention_heads * self.head_dim
        kv_size = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * (
            self.head_dim
        )
        # checkpoint piece -> (our fused name, start row, rows)
        shards = {
            "q_proj": ("qkv_proj", 0, q_size),
            "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        fused_seen: dict[str, int] = {}
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, rows = name, None
            parts = name.split(".")
            if len(parts) >= 3 and parts[-2] in shards:
                fused, start, size = shards[parts[-2]]
                target = ".".join([*parts[:-2], fused, parts[-1]])
                rows = (start, size)
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected checkpoint weight {name!r}")
            dst = param.data if rows is None else param.data.narrow(0, rows[0], rows[1])
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            if rows is None:
                pending.discard(target)
            else:
                fused_seen[target] = fused_seen.get(target, 0) + rows[1]
                if fused_seen[target] == param.shape[0]:
                    pending.discard(target)
        if pending:
            raise ValueError(f"checkpoint is missing weights: {sorted(pending)}")
