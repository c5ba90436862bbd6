"""Quantized linear layers: GGUF, AWQ / GPTQ and load-time int4 weights kept in groups of 32
inputs, multiplied without a dense copy.

`Int4Linear` holds a weight as 4-bit q with a scale and zero a group, w = (q - 8) * scale + zero;
`Q8Linear` as int8 q with a scale a group (or every 16 inputs: Q6_K), w = q * scale (the rows of
group_rows.py: GGUF blocks map onto them exactly).

Both layers take two paths where deja's kernels are handed to them (`use_kernel`: cpu_quant.cpp
on the CPU, cuda/quant_linear.cu on CUDA):
- up to GEMV_ROWS rows on the CPU, quant_linear.GEMV_ROWS (8) on CUDA (decode): a product on the
  groups that reads each weight byte once for every row and dequantizes nothing (float32 sums,
  whatever the activations' dtype);
- more rows (prefill): the weight expanded once per call to the activations' dtype, then a
  dense product; with int8 activations (ModelConfig.activations) on a CPU with AVX-512 VNNI
  every row count stays on the groups instead (tiled integer products; not an 8-bit weight with
  a scale every 16 inputs, Q6_K); with bfloat16 activations on a CPU with bfloat16 dot products
  (AVX512-BF16: AMD Zen 4 and later; AMX: Intel Sapphire Rapids and later), the slab product
  against the weight expanded 32 outputs at a time in a thread's buffer (cpu_quant_bf16.cpp):
  the same products as the expanded weight's up to summation order, without writing or reading
  a whole dense copy (int8 activations in bfloat16 take it past INT8_ROWS_BEFORE_AMX rows with
  AMX, INT8_ROWS_BEFORE_SLABS without, where it beats the integer tiles).
Without the kernels, torch ops expand the weight. Every path is the dequantized weight's product
up to summation order (the parity tests' float32 mode). A group's scale (and zero) stays the
file's float16 pair where that is exact (Q4_0, Q4_1, Q8_0: `_fp16_pair`), else float32 (Q4_K,
AWQ, GPTQ, load-time int4, Q6_K). Resident bytes a weight: 0.625 for 4-bit and 1.0625 for 8-bit
with float16 pairs (the file's own), 0.75 and 1.125 with float32, 1.25 for Q6_K.

NOTE: measured on a 2-core AMD EPYC (AVX-512), torch 2.13, float32, the weight in cache, ms a
call (product on the groups / a dense float32 weight, plain product): a 3072 x 576 weight at 1 row
0.028 (8-bit 0.025) / 0.091; 16 rows 0.22 / 0.43; 64 rows 0.86 / 1.51; the 49152 x 576 LM head
in 8-bit at 1 row 0.33 against 6.4, at 16 rows 3.3 against 14.1. Hence GEMV_ROWS = 64. A call
costs ~4.7 us besides its weights. In bfloat16 with bf16 units the dense product is ~3x faster
and the expansion 0.06 ms: 3072 x 576 at 16 rows 0.30 on the groups against 0.18 expanded, hence
8 rows there. Expanded in float32, the weight is packed for oneDNN per call (3072 x 576 at 512
rows: 4.2 ms against 8.5 for a plain product; in bfloat16 packing did not pay: 2.1 against 1.95).
In a model (weights streamed from memory, not cache) the 4-bit layers of the demo's file read
~31 GB/s of a 45-50 GB/s machine; they are ~55% of a decode step (`deja bench quant`).

`quantize_linears` swaps every nn.Linear whose checkpoint tensors were all kept quantized (fused
projections included: their shards' rows are concatenated, all 4-bit or all 8-bit) for one of
them, after the model has loaded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.worker.cpu_features import has_bf16_units
from engine.worker.gguf_checkpoint import QuantizedRows
from engine.worker.models.layers.group_rows import GROUP, Int4Rows, Int4Sources, Q8Rows
from engine.worker.models.layers.linear import PackedLinear
from engine.worker.models.layers.weights import renamed, shard_map

GEMV_ROWS = 64
"""Rows up to which a quantized linear multiplies on its groups (cpu_quant.cpp's few-row
product); from here on it expands the weight once per call and takes a dense product (see the
module docstring's NOTE)."""
GEMV_ROWS_BF16_UNITS = 8
"""The same in bfloat16 / float16 on a CPU with bf16 units, whose dense products are ~3x
float32's."""
EVERY_ROW = 1 << 62
"""A row bound no step reaches: a weight with int8 activations on AVX-512 VNNI multiplies every
row count on its groups (cpu_quant_i8.cpp's tiles: 1.4-1.6x oneDNN's bf16 product of the
expanded weight at 48 and 512 rows on Zen 4; Q6_K's 16-input scales excepted; in bfloat16 with
the slab product, rows past INT8_ROWS_BEFORE_AMX / INT8_ROWS_BEFORE_SLABS take it instead)."""

INT8_ROUNDING = "asymmetric-32"
"""How int8 activations are rounded (cpu_quant_i8.cpp: over each group of 32's own range, with
an integer offset); part of the KV fingerprint, so blocks written under another rounding are not
shared."""

INT8_ROWS_BEFORE_AMX = 16
"""With int8 activations on a CPU with AMX, rows up to which the int8 tiles multiply; beyond,
the bfloat16 AMX product (activations not rounded to int8), faster from about here: a 3072 x 576
4-bit weight on a 2-core Sapphire Rapids-class Xeon, ms at 16 / 48 / 512 rows, 0.15 / 0.25 / 1.4
on AMX against 0.17 / 0.40 / 4.4 in int8 tiles (the tied 49152 x 576 Q8_0 head crosses later,
near 32 rows; one bound for every kept weight)."""

INT8_ROWS_BEFORE_SLABS = 64
"""The same on a CPU whose slab product is vdpbf16ps (AVX512-BF16, no AMX): within ~10% of the
int8 tiles from ~32 rows on a 2-core Zen 5 EPYC (3072 x 576 4-bit at 48 / 128 / 512 rows: 0.24 /
0.53 / 2.1 ms against 0.21 / 0.51 / 2.2; the 49152 x 576 Q8_0 head 6.3 / 11.4 against 4.5 /
17.4), and a prefill spares rounding its rows; the bound is set by the whole model: the demo
file's 48-request throughput 481-572 -> 634-659 tok/s, 512-token TTFT 302-346 -> 253-259 ms with
int8 activations in bfloat16."""


class GroupedLinear(nn.Module):
    """y = x W^T (+ b) for a weight kept in groups of 32 inputs (Int4Linear, Q8Linear): few rows
    through the C++ product on the groups, many through the weight expanded once per call (or,
    in bfloat16 with bfloat16 dot products, 32 outputs at a time into the slab product); torch
    ops expand it where the C++ kernels are not loaded."""

    qs: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, shape: tuple[int, int], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = shape
        if not fits(*shape):
            raise ValueError(
                f"a quantized weight needs in_features % {GROUP} == 0, got {tuple(shape)}"
            )
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self._ops: Any = None
        """The products' kernels once `use_kernel` handed them: torch.ops.deja_cpu_attn on the
        CPU, cuda/quant_linear.py on CUDA (None: torch ops only)."""
        self.int8_activations = False
        """The product on the groups quantizes x to int8 and takes integer dot products
        (cpu_quant_i8.cpp; ModelConfig.activations int8); otherwise float32 sums, exact."""
        self._tiled_int8 = False
        """`_ops` multiplies int8 activations by this weight at every row count (tiles)."""
        self._slabs = False
        """`_ops` multiplies bfloat16 activations by this weight in slabs past the few-row bound
        (cpu_quant_bf16.cpp), instead of a dense product of the expanded weight."""
        self._amx = False
        """The slabs run on AMX tiles (faster than int8 tiles past INT8_ROWS_BEFORE_AMX rows;
        vdpbf16ps past INT8_ROWS_BEFORE_SLABS)."""
        self._gemv_rows = {
            torch.float32: GEMV_ROWS,
            torch.bfloat16: GEMV_ROWS,
            torch.float16: GEMV_ROWS,
        }
        """Rows up to which each activation dtype takes the product on the groups."""

    def use_kernel(self, ops: Any) -> None:
        if not hasattr(ops, "q4_linear"):
            return
        self._ops = ops
        bound = getattr(ops, "GEMV_ROWS", None)  # cuda/quant_linear.py's own few-row bound
        if bound is not None:
            self._gemv_rows = dict.fromkeys(self._gemv_rows, int(bound))
            return
        self._tiled_int8 = self._tiles_int8(ops)
        if has_bf16_units():
            self._gemv_rows[torch.bfloat16] = self._gemv_rows[torch.float16] = GEMV_ROWS_BF16_UNITS
        slab_rows = int(ops.linear_bf16_rows()) if hasattr(ops, "linear_bf16_rows") else 0
        if slab_rows > 0:
            self._slabs = True
            self._amx = int(ops.linear_amx_rows()) > 0
            self._gemv_rows[torch.bfloat16] = slab_rows - 1

    def _tiles_int8(self, ops: Any) -> bool:
        """Whether `ops` multiplies int8 activations by this weight in tiles at any row count
        (cpu_quant_i8.cpp with AVX-512 VNNI), faster than expanding it for a dense product."""
        tile_rows = getattr(ops, "linear_i8_tile_rows", None)
        return tile_rows is not None and int(tile_rows()) > 0

    @property
    def has_kernel(self) -> bool:
        """Multiplies with the C++ kernels (`use_kernel` was handed them)."""
        return self._ops is not None

    def gemv_rows(self, dtype: torch.dtype) -> int:
        """Rows up to which activations of `dtype` take the product on the groups (every row
        count with int8 activations where the kernels tile them, unless the slab product takes
        bfloat16 rows past INT8_ROWS_BEFORE_AMX or INT8_ROWS_BEFORE_SLABS)."""
        if self.int8_activations and self._tiled_int8:
            if not (self._slabs and dtype == torch.bfloat16):
                return EVERY_ROW
            bound = INT8_ROWS_BEFORE_AMX if self._amx else INT8_ROWS_BEFORE_SLABS
            return max(bound, self._gemv_rows[dtype])
        return self._gemv_rows[dtype]

    def slab_from(self, dtype: torch.dtype) -> int:
        """Rows of `dtype` activations from which the slab product multiplies (0: never; its
        op keeps an 8-bit weight on the few-row product below 8 rows with vdpbf16ps)."""
        bound = self.gemv_rows(dtype)
        return bound + 1 if self._slabs and dtype == torch.bfloat16 and bound < EVERY_ROW else 0

    def step_rows(self, dtype: torch.dtype) -> int:
        """Rows of `dtype` activations this weight multiplies without expanding it: the few-row
        bound, or every row count where the slab product or the int8 tiles take the rest."""
        return EVERY_ROW if self.slab_from(dtype) else self.gemv_rows(dtype)

    @contextmanager
    def products_on_every_row(self) -> Iterator[None]:
        """Within: the product on the groups whatever the row count (scoring many rows with a
        decode step's numerics, e.g. int8 activations, which the expanded path does not have)."""
        saved = dict(self._gemv_rows)
        self._gemv_rows = dict.fromkeys(saved, EVERY_ROW)
        try:
            yield
        finally:
            self._gemv_rows = saved

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _slab_product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _dense(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # [M, in]
        if self._ops is not None and flat.shape[0] <= self.gemv_rows(flat.dtype):
            out = self._product(flat)  # (the C++ op reads any strides)
        elif self._slabs and flat.dtype == torch.bfloat16:
            out = self._slab_product(flat)
        elif self._ops is not None and flat.dtype == torch.float32 and flat.device.type == "cpu":
            # oneDNN's packed product repays packing the expanded weight: ~2x a plain one
            out = PackedLinear(self._dense(flat.dtype)).apply_rows(flat.contiguous())
        else:
            out = torch.nn.functional.linear(flat, self._dense(flat.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


class Int4Linear(GroupedLinear):
    """A weight in 4-bit groups of 32 inputs: w = (q - 8) * scale + zero (cpu_quant.cpp's layout:
    16 bytes a group, byte j holding weights j and j + 16; float32 scale and zero a group, or
    float16 d = scale and m = zero - 8 scale where those are exact)."""

    zero: torch.Tensor

    def __init__(
        self,
        q: np.ndarray,
        scale: np.ndarray,
        zero: np.ndarray,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(q.shape, bias)
        n, k = q.shape
        nibbles = np.ascontiguousarray(q, dtype=np.uint8).reshape(n, k // GROUP, 2, GROUP // 2)
        packed = np.ascontiguousarray(nibbles[:, :, 0] | (nibbles[:, :, 1] << 4))
        self.register_buffer("qs", torch.from_numpy(packed.reshape(n, k // 2)), persistent=False)
        pair = _fp16_pair(scale, zero)
        scale_t, zero_t = (_groups(scale), _groups(zero)) if pair is None else pair
        self.register_buffer("scale", scale_t, persistent=False)
        self.register_buffer("zero", zero_t, persistent=False)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            return self._ops.q4_linear_i8(x, self.qs, self.scale, self.zero)
        return self._ops.q4_linear(x, self.qs, self.scale, self.zero)

    def _slab_product(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.q4_linear_bf16(x, self.qs, self.scale, self.zero)

    def _dense(self, dtype: torch.dtype) -> torch.Tensor:
        if self._ops is not None:
            return self._ops.q4_dequant(self.qs, self.scale, self.zero, dtype)
        n, k = self.out_features, self.in_features
        halves = torch.stack([self.qs & 15, self.qs >> 4], dim=1)  # [N, 2, K / 2]
        q = halves.view(n, 2, k // GROUP, GROUP // 2).transpose(1, 2).reshape(n, k // GROUP, GROUP)
        scale, zero = self.scale.float(), self.zero.float()
        if self.scale.dtype == torch.float16:  # (d, m): zero = m + 8d
            zero = zero + 8 * scale
        w = (q.float() - 8) * scale[..., None] + zero[..., None]
        return w.view(n, k).to(dtype)


class Q8Linear(GroupedLinear):
    """A weight in 8-bit groups of 32 inputs: w = q * scale (GGUF's Q8_0), or with a scale every
    16 inputs (GGUF's Q6_K, q its 6-bit value minus 32)."""

    def __init__(
        self, q: np.ndarray, scale: np.ndarray, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        super().__init__(q.shape, bias)
        self.register_buffer("qs", torch.from_numpy(np.ascontiguousarray(q)), persistent=False)
        half = _fp16_exact(scale)
        kept = _groups(scale) if half is None else torch.from_numpy(half)
        self.register_buffer("scale", kept, persistent=False)

    def _tiles_int8(self, ops: Any) -> bool:
        # (a scale every 16 inputs, Q6_K: its int8 entry takes the float product, untiled)
        return self.scale.shape[1] * GROUP == self.in_features and super()._tiles_int8(ops)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            return self._ops.q8_linear_i8(x, self.qs, self.scale)
        return self._ops.q8_linear(x, self.qs, self.scale)

    def _slab_product(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.q8_linear_bf16(x, self.qs, self.scale)

    def _dense(self, dtype: torch.dtype) -> torch.Tensor:
        if self._ops is not None:
            return self._ops.q8_dequant(self.qs, self.scale, dtype)
        n, k = self.out_features, self.in_features
        groups = self.scale.shape[1]
        w = self.qs.view(n, groups, k // groups).float() * self.scale.float()[..., None]
        return w.view(n, k).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the dequantized weight [len(ids), in] (a tied embedding's lookup)."""
        n, groups = ids.numel(), self.scale.shape[1]
        q = self.qs[ids].view(n, groups, -1).float()
        return (q * self.scale[ids].float()[..., None]).view(n, self.in_features).to(dtype)


def _groups(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def _fp16_pair(scale: np.ndarray, zero: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float16 d = scale and m = zero - 8 scale (a weight q d + m) where they give back scale and
    zero exactly (m + 8d in float32 == zero, as cpu_quant.cpp sums it): GGUF's Q4_0 and Q4_1
    pairs are; None where any group's is not (Q4_K, AWQ, GPTQ: float32 kept)."""
    s = np.ascontiguousarray(scale, dtype=np.float32)
    z = np.ascontiguousarray(zero, dtype=np.float32)
    d = _fp16_exact(s)
    if d is None:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        m = (z - np.float32(8) * s).astype(np.float16)
        back = m.astype(np.float32) + np.float32(8) * s
    if not np.array_equal(back, z):
        return None
    return torch.from_numpy(d), torch.from_numpy(m)


def _fp16_exact(values: np.ndarray) -> np.ndarray | None:
    """`values` as float16 where every one of them is a float16 value, else None."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    with np.errstate(over="ignore"):
        half = v.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), v) else None


def fits(out_features: int, in_features: int) -> bool:
    """Whether a quantized linear takes a weight of this shape (whole groups along the input)."""
    return out_features > 0 and in_features % GROUP == 0


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


class HeadRowsEmbedding(nn.Module):
    """A tied embedding that reads its rows from the LM head's Q8Linear (one copy of the
    vocabulary's weights, the one each step's logits read)."""

    def __init__(self, head: Q8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = [head]  # not a submodule: the head is the model's, counted once
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.head[0].rows(ids.reshape(-1), self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)


def quantize_embedding(model: nn.Module, rows: QuantizedRows | None, blocks: bool = True) -> bool:
    """Replaces `model.model.embed_tokens` by an embedding over `rows` (its checkpoint tensor,
    kept quantized): the tied LM head's rows where that head is a Q8Linear of them, else (with
    `blocks`) a QuantizedEmbedding; False, leaving it, where there is none or it is not an
    nn.Embedding. Without `blocks` (CUDA: a lookup through gguf's numpy dequantization would
    wait on the device every step) the expanded embedding stays."""
    inner = getattr(model, "model", None)
    embedding = getattr(inner, "embed_tokens", None)
    if rows is None or not isinstance(embedding, nn.Embedding):
        return False
    dtype = embedding.weight.dtype
    head = getattr(model, "lm_head", None)
    tied = getattr(model, "tie_word_embeddings", False)
    if tied and isinstance(head, Q8Linear) and rows.kind.name in ("Q8_0", "Q6_K"):
        inner.embed_tokens = HeadRowsEmbedding(head, dtype)  # type: ignore[union-attr]
    elif not blocks:
        return False
    else:
        inner.embed_tokens = QuantizedEmbedding(rows, dtype)  # type: ignore[union-attr]
    return True


def quantize_linears(model: nn.Module, sources: Int4Sources, rename: Mapping[str, str]) -> int:
    """Replaces each nn.Linear of `model` whose weight rows all came from kept tensors of
    `sources` (transformers names; `rename` as the model's load_checkpoint used), all 4-bit or
    all 8-bit, by an Int4Linear or a Q8Linear; returns how many it replaced. Call after loading,
    before packing for the CPU."""
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
        if len({type(u) for u in ordered}) > 1:
            continue  # 4-bit and 8-bit shards of one fused weight: stays dense
        ordered = _common_groups(ordered)
        f = [np.concatenate([u[i] for u in ordered]) for i in range(len(ordered[0]))]
        dtype = linear.weight.dtype
        layer: GroupedLinear
        if isinstance(ordered[0], Int4Rows):
            layer = Int4Linear(f[0], f[1], f[2], linear.bias, dtype)
        else:
            layer = Q8Linear(f[0], f[1], linear.bias, dtype)
        del ordered, f
        setattr(parent, attr, layer)
        replaced += 1
    return replaced


def _common_groups(parts: list[Int4Rows | Q8Rows]) -> list[Int4Rows | Q8Rows]:
    """A fused weight's shards (all 4-bit or all 8-bit) with one scale width: where an 8-bit one
    has a scale every 16 inputs (Q6_K), the others' scales repeated to 16 (exact)."""
    widths = {u.scale.shape[1] for u in parts}
    if not isinstance(parts[0], Q8Rows) or len(widths) < 2:
        return parts
    wide = max(widths)
    return [Q8Rows(u.q, np.repeat(u.scale, wide // u.scale.shape[1], axis=1)) for u in parts]


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
