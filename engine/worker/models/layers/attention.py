"""Self-attention over the paged KV cache: fused q/k/v projection, optional per-head QK norm
(Qwen3, Gemma 3), rotary (full or partial), the scale from the config, and the layer's sliding
window and logit soft-cap handed to the backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.worker.attention.base import AttentionBackend, AttentionMetadata
from engine.worker.models.layers.linear import new_linear
from engine.worker.models.layers.norm import NormClass
from engine.worker.models.layers.rotary import apply_rope

if TYPE_CHECKING:
    from engine.worker.parallel.group import TPGroup


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """How one layer's attention is shaped; the family file fills it from its config."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    """Multiplies q.k (head_dim ** -0.5 unless the config says otherwise)."""
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: NormClass | None = None
    """Per-head norm of q and k before the rotary (q_norm / k_norm weights of head_dim)."""
    norm_eps: float = 1e-6
    sliding_window: int | None = None
    """Keys further back than this many positions are not attended (None: all)."""
    logits_soft_cap: float | None = None
    """Scores become cap * tanh(scores / cap) before the softmax (None: no cap)."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logits_soft_cap is not None and self.logits_soft_cap <= 0:
            raise ValueError(f"attention soft-cap must be > 0, got {self.logits_soft_cap}")


class Attention(nn.Module):
    """With a tensor-parallel group: this rank's heads only (column-parallel q/k/v, row-parallel
    o_proj summed over the ranks; o_proj's bias on rank 0 alone)."""

    def __init__(
        self,
        spec: AttentionSpec,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.q_start = self.kv_start = 0
        if tp is not None:
            self.q_start, self.num_heads = tp.heads(spec.num_heads, spec.num_kv_heads)
            self.kv_start, self.num_kv_heads = tp.kv_heads(spec.num_kv_heads)
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * spec.head_dim
        self.kv_size = self.num_kv_heads * spec.head_dim
        self.qkv_proj = new_linear(
            spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, dtype
        )
        o_bias = spec.o_bias and (tp is None or tp.rank == 0)
        self.o_proj = new_linear(self.q_size, spec.hidden_size, o_bias, dtype)
        self.kernel: Any = None
        """torch.ops.deja_cpu_attn (its `rope`), or None: RoPE in torch ops (`apply_rope`)."""
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if spec.qk_norm is not None:
            self.q_norm = spec.qk_norm(spec.head_dim, spec.norm_eps, dtype)
            self.k_norm = spec.qk_norm(spec.head_dim, spec.norm_eps, dtype)
        self.backend = backend

    def checkpoint_shards(self) -> dict[str, tuple[str, int, int]]:
        """checkpoint name (relative to this module) -> (our parameter, first row, rows)."""
        q, kv = self.q_size, self.kv_size
        out = {}
        for suffix in ("weight", "bias"):
            out[f"q_proj.{suffix}"] = (f"qkv_proj.{suffix}", 0, q)
            out[f"k_proj.{suffix}"] = (f"qkv_proj.{suffix}", q, kv)
            out[f"v_proj.{suffix}"] = (f"qkv_proj.{suffix}", q + kv, kv)
        return out

    def tp_slices(self) -> dict[str, tuple[int, int, int] | None]:
        """Checkpoint name -> (dim, start, length) this rank reads; None: not on this rank."""
        d = self.head_dim
        q = (0, self.q_start * d, self.q_size)
        kv = (0, self.kv_start * d, self.kv_size)
        out: dict[str, tuple[int, int, int] | None] = {}
        for suffix in ("weight", "bias"):
            out[f"q_proj.{suffix}"], out[f"k_proj.{suffix}"], out[f"v_proj.{suffix}"] = q, kv, kv
        out["o_proj.weight"] = (1, self.q_start * d, self.q_size)
        if self.o_proj.bias is None:
            out["o_proj.bias"] = None
        return out

    def use_kernel(self, ops: Any) -> None:
        """Applies RoPE with the CPU kernel from now on (one call instead of ~8 torch ops)."""
        self.kernel = ops

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] -> [T, H, D] rotated (the same bits either way; see cpu_layers.cpp)."""
        if (
            self.kernel is not None
            and x.dtype in (torch.float32, torch.bfloat16)
            and cos.dtype == x.dtype
            and x.stride(-1) == 1
            and cos.stride(-1) == 1
            and sin.stride(-1) == 1
        ):
            out: torch.Tensor = self.kernel.rope(x, cos, sin)
            return out
        return apply_rope(x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: [T, hidden]; cos/sin: [T, 1, R / 2]; kv_cache: [2, NB, BS, Hkv, D] -> [T, hidden]."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 * Hkv) * D]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is None or self.k_norm is None:
            # q and k heads side by side get one RoPE: [T, Hq + Hkv, D]
            q, k = self._rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            q = self._rope(self.q_norm(q), cos, sin)  # [T, Hq, D]
            k = self._rope(self.k_norm(k), cos, sin)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        out = self.backend.forward(
            q,
            k,
            v,
            kv_cache,
            meta,
            self.spec.scale,
            sliding_window=self.spec.sliding_window,
            logits_soft_cap=self.spec.logits_soft_cap,
        )  # [T, Hq, D]
        out = self.o_proj(out.reshape(num_tokens, self.q_size))  # [T, hidden]
        if self.tp is not None:
            self.tp.all_reduce(out)  # the other ranks' heads' share
        return out
