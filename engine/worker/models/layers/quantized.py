"""Quantized linear layers: GGUF weights kept in 4-bit groups, multiplied without a 16-bit copy.

`Int4Linear` holds a weight in torch's packed int4 layout and applies it with
`torch.ops.aten._weight_int4pack_mm_for_cpu` (groups of 32 along the input, an int4 value q per
weight dequantized as (q - 8) * scale + zero). GGUF blocks map onto it exactly:

- Q4_1 (fp16 d, fp16 m, 32 nibbles q): w = d * q + m, so scale = d, zero = m + 8d;
- Q4_0 (fp16 d, 32 nibbles q): w = d * (q - 8), so scale = d, zero = 0;
- Q4_K (256-weight super-blocks: fp16 d and dmin, eight 6-bit scales sc and mins m, 256 nibbles):
  sub-block j of 32 weights is w = d sc_j q - dmin m_j, so scale = d sc_j, zero = 8 scale -
  dmin m_j (the type most of a Q4_K_M file's linears are in).

The int4 kernel is vectorized for bfloat16 activations only (scales rounded to bf16: at most d/64
a weight), and its time grows with the rows like a compute-bound loop. So an Int4Linear has two
paths (`use_kernel` enables the second where the C++ kernels load and their layout check passes):
- bf16 below DENSE_ROWS rows: torch's int4 kernel;
- from DENSE_ROWS rows, and always in float32 (where torch's kernel is a scalar loop): the weight
  expanded once per call by cpu_quant.cpp into a dense transposed weight, then a dense product
  (it reads torch's packed layout of AVX-512 and AVX2 builds; a probe at start finds which).
Either is exact to the summation order against the dequantized weight in float32 (the parity
tests' mode). Resident bytes a weight (bf16): 0.625 (file: 0.5625 for Q4_0, 0.625 for Q4_1).

NOTE: measured on a 2-core AMD EPYC (avx512_bf16), torch 2.13, bf16, a 960 x 576 weight, ms a
call (int4 kernel / expanded path / oneDNN's packed dense bf16): 1 row 0.014 / 0.016 / 0.029;
32 rows 0.115 / 0.137 / 0.071; 128 rows 0.434 / 0.258 / 0.168; 512 rows 1.705 / 0.696 / 0.599
(the expansion alone 0.056). Hence DENSE_ROWS = 64: one stream decodes ~2x faster per layer than
dense bf16, a long prefill costs ~1.2x, a batch of 16-48 rows ~1.6x.
Q8_0 is not made a linear: as two int4 halves ([HI | LO] over [x | x], exact) the 49152 x 576
LM head ran as fast as bf16 at one row (1.30 vs 1.28 ms) and 4x slower at 32 rows; a Q8_0
weight is expanded to dtype. A Q8_0 (or any other type's) embedding stays in its blocks
(QuantizedEmbedding): a lookup reads a few rows.

`quantize_linears` swaps every nn.Linear whose checkpoint tensors were all kept quantized (fused
projections included: their shards' rows are concatenated before packing) for an Int4Linear,
after the model has loaded (CPU only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from engine.worker.gguf_checkpoint import QuantizedRows
from engine.worker.models.layers.weights import renamed, shard_map

GROUP = 32
"""Weights a GGUF Q4 block (and a scale / zero pair) covers, along the input dimension."""


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block, as float32."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


class Int4Rows(NamedTuple):
    """A weight in the int4 op's convention: w = (q - 8) * scale + zero, groups of 32 inputs."""

    q: np.ndarray
    """int32 [N, K], values 0..15."""
    scale: np.ndarray
    """float32 [N, K / 32]."""
    zero: np.ndarray
    """float32 [N, K / 32]."""

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.q.shape
        return n, k


def unpack(rows: QuantizedRows) -> Int4Rows:
    """A Q4_0 or Q4_1 weight's rows in the int4 op's convention."""
    from gguf import GGMLQuantizationType as T

    n, k = rows.shape
    if rows.kind == T.Q4_1:
        blocks = rows.blocks.reshape(n, k // GROUP, 20)
        d, m = _fp16(blocks, 0), _fp16(blocks, 2)
        nibbles = blocks[..., 4:]
        zero = m + 8 * d
    elif rows.kind == T.Q4_0:
        blocks = rows.blocks.reshape(n, k // GROUP, 18)
        d = _fp16(blocks, 0)
        nibbles = blocks[..., 2:]
        zero = np.zeros_like(d)
    elif rows.kind == T.Q4_K:
        return _unpack_q4_k(rows)
    else:
        raise ValueError(f"{rows.kind.name} is not a type Int4Linear holds (Q4_0, Q4_1, Q4_K)")
    # a block's 16 bytes hold weights j (low nibble) and j + 16 (high nibble)
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(n, k).astype(np.int32)
    return Int4Rows(q, d, zero)


def _unpack_q4_k(rows: QuantizedRows) -> Int4Rows:
    """A Q4_K weight: super-blocks of 256 (144 bytes: d, dmin, 12 bytes of 6-bit scales and
    mins, 128 bytes of nibbles; 32 bytes hold sub-block 2i in their low nibbles and 2i + 1 in
    their high ones), each sub-block of 32 one group."""
    from gguf.quants import Q4_K

    n, k = rows.shape
    blocks = rows.blocks.reshape(n * k // 256, 144)
    d, dmin = _fp16(blocks, 0)[:, None], _fp16(blocks, 2)[:, None]
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # [blocks, 8] each
    scale = d * sc.astype(np.float32)
    zero = 8 * scale - dmin * m.astype(np.float32)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, k).astype(np.int32)
    return Int4Rows(q, scale.reshape(n, k // GROUP), zero.reshape(n, k // GROUP))


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
"""GGUF types whose linears stay 4-bit (Int4Linear); the others are expanded to dtype."""


@dataclass(frozen=True)
class Int4Sources:
    """Weights that can become Int4Linears: each one's shape [out, in] by transformers name, and
    how to unpack it, called for the ones a linear takes, one at a time (an unpacked weight is
    ~4 bytes a weight: never all of them at once)."""

    shapes: Mapping[str, tuple[int, int]]
    unpack: Callable[[str], Int4Rows]


def gguf_int4(quantized: Mapping[str, QuantizedRows]) -> Int4Sources:
    """The 4-bit tensors (INT4_TYPES) of a GGUF file's kept ones."""
    shapes = {n: r.shape for n, r in quantized.items() if r.kind.name in INT4_TYPES}
    return Int4Sources(shapes, lambda name: unpack(quantized[name]))


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W [out, in] in packed int4 groups of 32; see the module docstring."""

    weight_packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(
        self,
        q: np.ndarray,
        scale: np.ndarray,
        zero: np.ndarray,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        if not fits(self.out_features, self.in_features):
            raise ValueError(
                f"an int4 weight needs out_features % 16 == 0 and in_features % {GROUP} == 0, "
                f"got {tuple(q.shape)}"
            )
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q), 1)
        self.register_buffer("weight_packed", packed, persistent=False)  # uint8 [out, in / 2]
        scales_and_zeros = np.stack([scale.T, zero.T], axis=-1)  # [in / 32, out, 2]
        sz = torch.from_numpy(np.ascontiguousarray(scales_and_zeros)).to(dtype)
        self.register_buffer("scales_and_zeros", sz, persistent=False)
        self.bias = None if bias is None else bias.detach()

        self._dequant: Any = None
        """torch.ops.deja_cpu_attn.int4_dequant_t once `use_kernel` has checked it (None: torch's
        int4 kernel at every row count)."""

    def use_kernel(self, ops: Any) -> None:
        """Takes the many-row path (the weight expanded by `ops.int4_dequant_t`, then a dense
        product) where the layout probe finds torch's row blocks and the shape allows
        (out_features a multiple of them)."""
        block = _packed_block_rows(ops)
        if block and self.out_features % block == 0:
            self._dequant = functools.partial(_expand, ops.int4_dequant_t, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()  # [M, in]
        dense = self._dequant is not None and (
            flat.shape[0] >= DENSE_ROWS or flat.dtype != torch.bfloat16
        )
        if dense:
            w_t = self._dequant(self.weight_packed, self.scales_and_zeros, GROUP)  # [in, out]
            out = torch.matmul(flat, w_t)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.weight_packed, GROUP, self.scales_and_zeros
            )  # [M, out]
            if self.bias is not None:
                out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def _expand(op: Any, block_rows: int, packed: torch.Tensor, sz: torch.Tensor, group: int) -> Any:
    return op(packed, sz, group, block_rows)


DENSE_ROWS = 64
"""Rows from which a bf16 Int4Linear expands its weight and takes a dense product (see the
module docstring's NOTE); float32 always does (torch's int4 kernel is scalar there)."""

_BLOCK_ROWS: dict[int, int] = {}


def _packed_block_rows(ops: Any) -> int:
    """The row blocks of this torch build's packed int4 layout that `ops.int4_dequant_t` reads
    (64 on AVX-512 builds, 32 on AVX2), found once per process on a probe weight packed by
    torch, expanded, against its values; 0 where neither reads it."""
    key = id(ops)
    if key not in _BLOCK_ROWS:
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=gen)
        sz = torch.randn(64 // GROUP, 128, 2, generator=gen)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        want = (q.view(128, 2, GROUP) - 8) * sz[..., 0].T[..., None] + sz[..., 1].T[..., None]
        _BLOCK_ROWS[key] = 0
        for block in (64, 32):
            try:
                got = ops.int4_dequant_t(packed, sz, GROUP, block).T
            except (RuntimeError, AttributeError):
                continue
            if torch.allclose(got, want.view(128, 64), rtol=1e-6, atol=1e-5):
                _BLOCK_ROWS[key] = block
                break
    return _BLOCK_ROWS[key]


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W int8 [out, in] and one scale a row (per channel, symmetric: w = q *
    scale); torch's int8 weight-only kernel in bf16, the weight expanded per call in float32
    (exact against the dequantized weight there)."""

    weight_int8: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        tiny = torch.finfo(dtype).tiny  # an all-zero row: a scale the dtype holds
        scale = (w.abs().amax(dim=1) / 127).to(dtype).float().clamp(min=tiny)  # as stored
        q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        self.register_buffer("weight_int8", q.contiguous(), persistent=False)
        self.register_buffer("scales", scale.to(dtype), persistent=False)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        if flat.dtype == torch.float32:
            out = flat @ (self.weight_int8.float() * self.scales[:, None]).T
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def rtn_int4(weight: torch.Tensor) -> Int4Rows:
    """A weight [N, K] rounded to nearest in asymmetric groups of 32 (min / max), in Int4Linear's
    convention, with the scale and zero rounded to the weight's dtype first (as they are stored)
    so that q is the nearest value given them."""
    dtype = weight.dtype
    n, k = weight.shape
    g = weight.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).to(dtype).float().clamp(min=torch.finfo(dtype).tiny)
    zero = (lo + 8 * scale).to(dtype).float()
    q = torch.clamp(torch.round((g - zero[..., None]) / scale[..., None]) + 8, 0, 15)
    return Int4Rows(q.reshape(n, k).to(torch.int32).numpy(), scale.numpy(), zero.numpy())


def quantize_loaded(model: nn.Module, kind: str) -> int:
    """Load-time weight-only quantization (`--quantization int4|int8`): every attention and MLP
    projection (an nn.Linear named *_proj; not the LM head, the router or the experts) becomes an
    Int4Linear (rtn_int4) or an Int8Linear; returns how many. Call after loading, on the CPU.

    Under tensor parallelism each rank quantizes its shard: int4 groups run along a row's inputs,
    so where a rank's share of a row-parallel layer's inputs is a multiple of 32 the groups are
    those of one rank; int8's per-row scale is then of the rank's share of the row."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not name.endswith("_proj"):
            continue
        dtype = module.weight.dtype
        layer: nn.Module
        if kind == "int8":
            layer = Int8Linear(module.weight, module.bias, dtype)
        elif fits(module.out_features, module.in_features):
            layer = Int4Linear(*rtn_int4(module.weight), module.bias, dtype)
        else:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, layer)
        replaced += 1
    return replaced


def fits(out_features: int, in_features: int) -> bool:
    """Whether the int4 op takes a weight of this shape."""
    return out_features % 16 == 0 and in_features % GROUP == 0


class QuantizedEmbedding(nn.Module):
    """nn.Embedding over a GGUF weight kept in its blocks (any type gguf dequantizes): a lookup
    dequantizes only the rows it reads, with gguf.quants.dequantize."""

    blocks: torch.Tensor

    def __init__(self, rows: QuantizedRows, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind = rows.kind
        self.num_embeddings, self.embedding_dim = rows.shape
        self.register_buffer("blocks", torch.from_numpy(rows.blocks.copy()), persistent=False)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf import quants

        picked = self.blocks[ids.reshape(-1)].numpy()  # [T, bytes a row]
        rows = quants.dequantize(picked, self.kind)  # [T, dim] float32
        out = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        return out.to(self.dtype).view(*ids.shape, self.embedding_dim)


def quantize_embedding(model: nn.Module, rows: QuantizedRows | None) -> bool:
    """Replaces `model.model.embed_tokens` by a QuantizedEmbedding over `rows` (its checkpoint
    tensor, kept quantized); False, leaving it, where there is none or it is not an nn.Embedding."""
    inner = getattr(model, "model", None)
    embedding = getattr(inner, "embed_tokens", None)
    if rows is None or not isinstance(embedding, nn.Embedding):
        return False
    inner.embed_tokens = QuantizedEmbedding(rows, embedding.weight.dtype)  # type: ignore[union-attr]
    return True


def quantize_linears(model: nn.Module, sources: Int4Sources, rename: Mapping[str, str]) -> int:
    """Replaces each nn.Linear of `model` whose weight rows all came from 4-bit tensors of
    `sources` (transformers names; `rename` as the model's load_checkpoint used) by an
    Int4Linear; returns how many it replaced. Call after loading, before packing for the CPU."""
    replaced = 0
    for module_name, parts in _weight_sources(model, sources.shapes, rename).items():
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, attr)
        rows = sum(sources.shapes[n][0] for _, n in parts)
        if rows != linear.out_features or any(
            sources.shapes[n][1] != linear.in_features for _, n in parts
        ):
            continue  # not every row is quantized (or an expert's slice): stays dense
        if not fits(linear.out_features, linear.in_features):
            continue
        ordered = [sources.unpack(n) for _, n in sorted(parts)]
        q, scale, zero = (np.concatenate([u[i] for u in ordered]) for i in range(3))
        del ordered
        setattr(parent, attr, Int4Linear(q, scale, zero, linear.bias, linear.weight.dtype))
        replaced += 1
    return replaced


def _weight_sources(
    model: nn.Module, shapes: Mapping[str, tuple[int, int]], rename: Mapping[str, str]
) -> dict[str, list[tuple[int, str]]]:
    """nn.Linear module name -> [(first row, the name of its 4-bit rows)] for every tensor of
    `shapes` that fills (part of) that module's weight."""
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    shards = shard_map(model)
    out: dict[str, list[tuple[int, str]]] = {}
    for name in shapes:
        target = renamed(name, dict(rename))
        shard = shards.get(target)
        if shard is not None and shard.expert is not None:
            continue
        param, start = (shard.param, shard.start) if shard is not None else (target, 0)
        module = param.removesuffix(".weight")
        if param.endswith(".weight") and module in linears:
            out.setdefault(module, []).append((start, name))
    return out
