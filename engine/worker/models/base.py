"""The decoder every family shares: embed -> N x (attention, MLP or experts) -> norm -> LM head,
over one flat batch of tokens with a paged KV cache.

A family subclasses CausalLM and overrides only the hooks where it differs from Llama: the
attention of layer i (QK norm, scale, window, soft-cap), its MLP (gated, GELU, experts), the norm
class, sandwich norms around each block (Gemma), per-layer rotary settings, embedding scaling,
final logit soft-capping and checkpoint renames.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.worker.attention.base import AttentionBackend, AttentionMetadata
from engine.worker.models.compiled import CompiledStack
from engine.worker.models.layers.attention import Attention, AttentionSpec
from engine.worker.models.layers.linear import new_linear, pack_linears
from engine.worker.models.layers.mlp import GatedMLP
from engine.worker.models.layers.norm import NormClass, RMSNorm
from engine.worker.models.layers.quantized import GroupedLinear
from engine.worker.models.layers.rotary import RotaryEmbedding
from engine.worker.models.layers.weights import load_checkpoint, slice_map
from engine.worker.models.sliding_window import layer_windows

if TYPE_CHECKING:
    from engine.worker.parallel.group import TPGroup

logger = logging.getLogger(__name__)


def head_dim(cfg: Any) -> int:
    """config.head_dim, else hidden_size / num_attention_heads."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def num_kv_heads(cfg: Any) -> int:
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def backend_supports(backend: AttentionBackend, option: str) -> bool:
    """Whether the backend's forward takes `option` (sliding_window, logits_soft_cap)."""
    return option in inspect.signature(backend.forward).parameters


class DecoderLayer(nn.Module):
    """Pre-norm residual block; with `sandwich`, each block's output is normed too (Gemma):
    x += post_attention_layernorm(attn(input_layernorm(x)))
    x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))."""

    def __init__(
        self,
        attn: Attention,
        mlp: nn.Module,
        norm: NormClass,
        hidden: int,
        eps: float,
        dtype: torch.dtype,
        sandwich: bool,
    ) -> None:
        super().__init__()
        self.input_layernorm = norm(hidden, eps, dtype)
        self.self_attn = attn
        self.post_attention_layernorm = norm(hidden, eps, dtype)
        self.mlp = mlp
        self.sandwich = sandwich
        if sandwich:
            self.pre_feedforward_layernorm = norm(hidden, eps, dtype)
            self.post_feedforward_layernorm = norm(hidden, eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        h = self.self_attn(self.input_layernorm(x), *rope, kv_cache, meta)
        if not self.sandwich:
            x, normed = self.post_attention_layernorm.add_norm(x, h)  # x += h, then its norm
            return x + self.mlp(normed)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderModel(nn.Module):
    """transformers' `model.` prefix: embed_tokens, layers, norm."""

    def __init__(self, embed: nn.Module, layers: Iterable[DecoderLayer], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    """A decoder-only LM over a flat batch with a paged KV cache; Llama unless overridden."""

    norm_class: NormClass = RMSNorm
    sandwich_norms = False
    checkpoint_renames: dict[str, str] = {}
    """Substring of a checkpoint name -> ours (e.g. Mixtral's `.block_sparse_moe.` -> `.mlp.`)."""
    supports_tensor_parallel = False
    """The family splits over a tensor-parallel group (shared attention and gated MLP only)."""
    weight_quantization = "none"
    """The format its weights are kept in on the device (set by the loader): gguf, awq, gptq,
    int4, int8; none: every weight in the model's dtype."""
    supports_cuda_graphs = True
    """The forward never waits on the device (no host sync, shapes fixed by the batch), so a
    decode step can be captured as a CUDA graph (engine/worker/cuda_graphs.py)."""

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        backend: AttentionBackend,
        tp: TPGroup | None = None,
    ) -> None:
        """tp: this rank's tensor-parallel group (None: the whole model in this process)."""
        super().__init__()
        cfg = self.config = hf_config
        self.dtype = dtype
        self.backend = backend
        self.tp = tp
        if tp is not None and not self.supports_tensor_parallel:
            raise ValueError(f"{type(self).__name__} does not support tensor parallelism")
        self.head_dim = head_dim(cfg)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        eps = float(cfg.rms_norm_eps)
        self.windows = layer_windows(cfg)
        """Each layer's sliding window (None: full attention), as the KV manager reads them."""
        layers = []
        for i in range(cfg.num_hidden_layers):
            spec = self.attention_spec(i)
            for option, value in (
                ("sliding_window", spec.sliding_window),
                ("logits_soft_cap", spec.logits_soft_cap),
            ):
                if value is not None and not backend_supports(backend, option):
                    raise ValueError(
                        f"{type(self).__name__} needs {option}={value} on layer {i}, which the "
                        f"{backend.name!r} attention backend does not implement"
                    )
            attn = Attention(spec, dtype, backend, tp)
            layers.append(
                DecoderLayer(
                    attn,
                    self.build_mlp(i),
                    self.norm_class,
                    cfg.hidden_size,
                    eps,
                    dtype,
                    self.sandwich_norms,
                )
            )
        embed: nn.Module
        self.vocab_start, vocab_rows = 0, int(cfg.vocab_size)
        if tp is None:
            embed = torch.nn.utils.skip_init(nn.Embedding, vocab_rows, cfg.hidden_size, dtype=dtype)
        else:
            from engine.worker.parallel.embedding import VocabParallelEmbedding

            embed = VocabParallelEmbedding(vocab_rows, cfg.hidden_size, dtype, tp)
            self.vocab_start, vocab_rows = embed.start, embed.num_rows
        self.model = DecoderModel(embed, layers, self.norm_class(cfg.hidden_size, eps, dtype))
        self.lm_head = new_linear(cfg.hidden_size, vocab_rows, False, dtype)
        if self.tie_word_embeddings:
            tied = self.model.embed_tokens.weight
            assert isinstance(tied, nn.Parameter)
            self.lm_head.weight = tied
        self.layer_rope = [self.rope_key(i) for i in range(cfg.num_hidden_layers)]
        self.rotary = nn.ModuleDict(
            {key: RotaryEmbedding(cfg, self.head_dim, dtype, None if key == "default" else key)
             for key in dict.fromkeys(self.layer_rope)}
        )  # fmt: skip
        scale = self.embedding_scale()
        # transformers casts the scale to the model dtype before multiplying
        self.embed_scale: torch.Tensor | None
        self.register_buffer(
            "embed_scale", None if scale is None else torch.tensor(scale, dtype=dtype), False
        )
        self.final_soft_cap: float | None = getattr(cfg, "final_logit_softcapping", None)
        self.compiled: CompiledStack | None = None
        """The layers as one C++ call for decode steps, where `use_kernels` could build it."""

    # ---- hooks a family overrides ----

    def attention_spec(self, layer: int) -> AttentionSpec:
        """Layer `layer`'s attention: Llama's, with q/k/v bias where the config asks for it."""
        cfg = self.config
        bias = bool(getattr(cfg, "attention_bias", False))
        return AttentionSpec(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=num_kv_heads(cfg),
            head_dim=self.head_dim,
            scale=self.head_dim**-0.5,
            qkv_bias=bias,
            o_bias=bias,
            sliding_window=self.windows[layer],
        )

    def build_mlp(self, layer: int) -> nn.Module:
        cfg = self.config
        act = str(getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", "silu"))
        bias = bool(getattr(cfg, "mlp_bias", False))
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, act, bias, self.dtype, self.tp)

    def rope_key(self, layer: int) -> str:
        """Which rotary setting layer `layer` uses: a key of a per-layer-type rope_parameters
        (Gemma 3), or "default" for the config's only one."""
        return "default"

    def embedding_scale(self) -> float | None:
        """Multiplies the token embeddings (Gemma: sqrt(hidden_size)); None: no scaling."""
        return None

    # ---- the shared forward ----

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
        ropes = {key: rotary(positions) for key, rotary in self.rotary.items()}  # [T, 1, R/2]
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if self.compiled is not None:
            slots = self.compiled.step_slots(h.shape[0], kv_cache, meta)
            if slots is not None:  # the same bits in one C++ call (models/compiled.py)
                return self.compiled.run(h, ropes["default"], kv_cache, meta, slots)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, ropes[self.layer_rope[i]], kv_cache[i], meta)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32 (soft-capped where the family caps).

        Tensor-parallel: every rank computes its vocabulary slice; all of them get the whole."""
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, int(self.config.vocab_size))
        if self.final_soft_cap is not None:
            logits = torch.tanh(logits / self.final_soft_cap) * self.final_soft_cap
        return logits.float()

    def use_cpu_layout(self, kernels: Any = None) -> None:
        """Packs every projection for oneDNN (PackedLinear); call once, after loading, when the
        model runs on the CPU. A tied lm_head gets its own packed copy (the embedding keeps its
        rows): vocab x hidden more memory, for the largest product of every step.

        kernels: torch.ops.deja_cpu_attn (the C++ CPU kernels) when loaded: every RMSNorm and
        RoPE then runs in one call (cpu_layers.cpp), and a model the compiled decoder stack takes
        runs its decode steps in one (models/compiled.py); None keeps torch's ops."""
        pack_linears(self)
        if kernels is not None:
            self.use_kernels(kernels)
            self.compiled, reason = CompiledStack.build(self, kernels)
            compiled = "one C++ call a step of few tokens" if self.compiled else reason
            logger.info("decoder stack: %s", compiled)

    def quantize_activations(self, kernels: Any) -> None:
        """Every linear kept 4- or 8-bit multiplies int8-quantized activations from now on
        (ModelConfig.activations int8); call before `use_cpu_layout`. ValueError where the model
        keeps none, or the C++ CPU kernels (`kernels`) are not loaded."""
        kept = [m for m in self.modules() if isinstance(m, GroupedLinear)]
        if kernels is None or not kept:
            why = (
                "they are not loaded (int8 activations are a CPU path)"
                if kept
                else "this model keeps none (a 16-bit checkpoint, or quantization none)"
            )
            raise ValueError(
                "activations int8 multiplies weights kept 4- or 8-bit with the C++ CPU "
                f"kernels; {why}: use activations float"
            )
        for linear in kept:
            linear.int8_activations = True

    def use_kernels(self, ops: Any, quant_ops: Any = None) -> None:
        """Runs every RMSNorm (the residual add fused in), RoPE and, where `ops` has it,
        SiLU-and-mul with `ops`: one call each instead of torch's composites of ~8, ~7 and 2 small
        ops; a quantized linear multiplies on its groups with `quant_ops`, or `ops` where that
        has the products (layers/quantized.py). On the CPU torch.ops.deja_cpu_attn for both
        (cpu_layers.cpp, cpu_quant.cpp, through `use_cpu_layout`), on CUDA cuda/layers.py and
        cuda/quant_linear.py (deja's kernels); call once, after loading."""
        for module in self.modules():
            if isinstance(module, GroupedLinear):
                module.use_kernel(ops if quant_ops is None else quant_ops)
            elif isinstance(module, RMSNorm | Attention | GatedMLP):
                module.use_kernel(ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face checkpoint tensors (names as in transformers) into our layout.

        Raises ValueError naming the tensor on an unknown name, a shape mismatch, a repeat, or a
        weight missing at the end.
        """
        skip = ["lm_head.weight"] if self.tie_word_embeddings else []
        if self.tp is not None:
            skip += [name for name, part in slice_map(self).items() if part is None]
        load_checkpoint(self, weights, rename=self.checkpoint_renames, skip=skip)

    def tp_slices(self) -> dict[str, tuple[int, int, int] | None]:
        """The LM head's vocabulary rows (tensor-parallel; the embedding declares its own)."""
        if self.tp is None or self.tie_word_embeddings:
            return {}
        return {"lm_head.weight": (0, self.vocab_start, self.lm_head.out_features)}
