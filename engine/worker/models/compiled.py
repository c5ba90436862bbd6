"""The decoder's layer stack in one C++ call a step (cpu_decoder.cpp's DecoderStack), for a
Llama-shaped model kept quantized on the CPU.

A decode step of a small model spends more time in Python between the kernels (~40 calls a
layer: the modules, views, splits, the backend's checks) than in them: on the demo's 30 layers,
milliseconds a token. The stack runs the same kernels and torch ops in the same order, so its
output is the same bits as the modules' forward; `CausalLM.forward` hands it every step it takes
(few tokens, every one attended by the CPU kernel) and runs the rest itself.

It takes: RMSNorm, pre-norm residual blocks (no sandwich norms), attention without QK norm,
sliding window or soft cap, one rotary setting, a SiLU-gated MLP, every projection kept in
4-bit or 8-bit groups (GGUF, AWQ, GPTQ, load-time int4), float32 or bfloat16, one rank, the C++
attention kernel over a cache of the model's dtype. `build` says why it does not take a model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.worker.attention.base import AttentionMetadata
from engine.worker.attention.cpu_paged import (
    MAX_BLOCK_SIZE,
    MAX_GROUP,
    MAX_HEAD_DIM,
    CpuPagedAttentionBackend,
)
from engine.worker.models.layers.attention import Attention
from engine.worker.models.layers.mlp import GatedMLP
from engine.worker.models.layers.norm import RMSNorm
from engine.worker.models.layers.quantized import GroupedLinear, Int4Linear

_NONE = torch.empty(0)
"""An absent zero or bias in the stack's weight list."""


class CompiledStack:
    """The model's layers and final norm as one DecoderStack; `step_slots` says whether a step
    is one it runs, `run` runs it."""

    def __init__(
        self, stack: Any, dtype: torch.dtype, max_tokens: int, backend: CpuPagedAttentionBackend
    ) -> None:
        self.stack = stack
        self.dtype = dtype
        self.max_tokens = max_tokens
        """Tokens a step at most: where the linears would expand a weight past it
        (GroupedLinear.step_rows)."""
        self.backend = backend

    @staticmethod
    def build(model: Any, ops: Any) -> tuple[CompiledStack | None, str]:
        """The stack for `model` (a CausalLM after loading, its kernels in use), or None and why
        the model is not one it takes."""
        reason = _unsupported(model, ops)
        if reason is not None:
            return None, reason
        weights: list[torch.Tensor] = []
        linears: list[GroupedLinear] = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            weights.append(layer.input_layernorm.weight)
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                zero = linear.zero if isinstance(linear, Int4Linear) else _NONE
                bias = _NONE if linear.bias is None else linear.bias
                weights += [linear.qs, linear.scale, zero, bias]
                linears.append(linear)
            weights.append(layer.post_attention_layernorm.weight)
        weights.append(model.model.norm.weight)
        first = model.model.layers[0].self_attn
        stack = torch.classes.deja_cpu_attn.DecoderStack(
            [w.detach() for w in weights],
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            float(model.config.rms_norm_eps),
            float(first.spec.scale),
            linears[0].int8_activations,
            [linear.slab_from(model.dtype) for linear in linears],
        )
        max_tokens = min(linear.step_rows(model.dtype) for linear in linears)
        return CompiledStack(stack, model.dtype, max_tokens, model.backend), "compiled"

    def step_slots(
        self, num_tokens: int, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The step's cache slots [T] int64 when the stack runs this step; None when the modules
        do (more tokens than the linears take without expanding a weight, a prefill chunk the
        backend sends to SDPA, padding, an fp8 cache or a KV observer)."""
        if (
            num_tokens > self.max_tokens
            or meta.max_query_len >= self.backend.sdpa_min_queries
            or kv_cache.dtype != self.dtype
            or kv_cache.shape[3] > MAX_BLOCK_SIZE
            or self.backend.kv_observer is not None
            or sum(meta.query_lens_cpu) != num_tokens
            or not kv_cache.is_contiguous()
        ):
            return None
        return self.backend.step_slots(meta)

    def run(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """h: [T, hidden] embedded tokens -> the final-norm hidden states [T, hidden]."""
        out: torch.Tensor = self.stack.run(
            h,
            rope[0],
            rope[1],
            kv_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            slots,
        )
        return out


def _unsupported(model: Any, ops: Any) -> str | None:
    """Why the stack does not take `model` (None: it does)."""
    if ops is None or not hasattr(ops, "paged_attention"):
        return "the C++ CPU kernels are not loaded"
    if model.tp is not None:
        return "tensor parallelism"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {model.dtype}"
    if not isinstance(model.backend, CpuPagedAttentionBackend):
        return f"the {model.backend.name!r} attention backend"
    if set(model.layer_rope) != {"default"} or model.rotary["default"].cos_sin_cache.dtype != (
        model.dtype
    ):
        return "per-layer rotary settings"
    if not _kernel_norm(model.model.norm):
        return "its norm"
    for i, layer in enumerate(model.model.layers):
        reason = _layer_unsupported(layer)
        if reason is not None:
            return f"layer {i}: {reason}"
    return None


def _layer_unsupported(layer: Any) -> str | None:
    attn, mlp = layer.self_attn, layer.mlp
    if layer.sandwich or not (
        _kernel_norm(layer.input_layernorm) and _kernel_norm(layer.post_attention_layernorm)
    ):
        return "its norms"
    if not isinstance(attn, Attention) or attn.kernel is None or attn.tp is not None:
        return "its attention"
    spec = attn.spec
    if spec.qk_norm is not None or spec.sliding_window is not None or spec.logits_soft_cap:
        return "QK norm, a sliding window or a soft cap"
    if attn.head_dim > MAX_HEAD_DIM or attn.num_heads // attn.num_kv_heads > MAX_GROUP:
        return "its heads"
    if not isinstance(mlp, GatedMLP) or mlp.act is not F.silu or mlp.kernel is not None:
        return "its MLP"
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        if not isinstance(linear, GroupedLinear) or not linear.has_kernel:
            return "a projection not kept quantized"
    return None


def _kernel_norm(norm: Any) -> bool:
    return type(norm) is RMSNorm and norm.kernel is not None
