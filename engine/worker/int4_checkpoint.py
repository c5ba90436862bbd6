"""AWQ and GPTQ int4 checkpoints: a Hugging Face folder whose config.json has a
`quantization_config` and whose linears are stored as packed `qweight`, `qzeros` and `scales`.

Both formats dequantize a weight as w = (q - z) * s, with q and z 4-bit and s one fp16 scale per
group of `group_size` inputs (-1: one group for the whole input). They differ in packing:

- AWQ (version gemm): qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], eight
  output columns a word in the order 0, 2, 4, 6, 1, 3, 5, 7 (column j in nibble AWQ_NIBBLE[j]);
- GPTQ: qweight int32 [in / 8, out], eight inputs a word in order; qzeros int32
  [groups, out / 8], eight columns in order, holding z - 1 (checkpoint_format "gptq", the
  original off-by-one) or z ("gptq_v2"); g_idx [in], each input's group, must be in order
  (desc_act reorders it: refused).

Each linear becomes Int4Rows in Int4Linear's convention (layers/quantized.py): w = (q - 8) * s +
(8 - z) * s, the scales and zeros repeated to groups of 32 (exact). `weights()` yields every
tensor the model loads, each linear's weight dequantized to float32 (so the loader checks names
and shapes as for any checkpoint); `sources()` then unpacks the kept ones, one linear at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.worker.models.layers.group_rows import GROUP, Int4Rows, Int4Sources

METHODS = ("awq", "gptq")
SUPPORTED = (
    "AWQ (4 bits, version gemm, zero_point) and GPTQ (4 bits, desc_act false, checkpoint_format "
    "gptq or gptq_v2), group_size a multiple of 32 or -1"
)
AWQ_NIBBLE = np.array([0, 4, 1, 5, 2, 6, 3, 7])
"""The nibble of an AWQ word that holds output column j (of eight)."""
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class Int4Format:
    method: str
    """awq or gptq."""
    group_size: int
    """Inputs a scale covers; -1: the whole input."""
    zero_offset: int = 0
    """Added to a stored zero (1 for GPTQ's original format)."""


def read_format(hf_config: Any) -> Int4Format | None:
    """The checkpoint's int4 format from its quantization_config (None without one); ValueError
    naming the setting for a method or option deja does not serve."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(
            f"quantization_config quant_method {method!r} is not supported: deja serves {SUPPORTED} "
            "folders, and GGUF files"
        )
    bits = qc.get("bits", qc.get("w_bit"))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    refusal = None
    if bits != 4:
        refusal = f"bits {bits}"
    elif group != -1 and (group <= 0 or group % GROUP):
        refusal = f"group_size {group}"
    elif method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        refusal = f"version {qc.get('version')!r}"
    elif method == "awq" and not qc.get("zero_point", True):
        refusal = "zero_point false"
    elif method == "gptq" and qc.get("desc_act"):
        refusal = "desc_act true (inputs reordered by act-order)"
    elif method == "gptq" and qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        refusal = f"checkpoint_format {qc.get('checkpoint_format')!r}"
    if refusal is not None:
        raise ValueError(
            f"a {method.upper()} checkpoint with {refusal} is not supported: {SUPPORTED}"
        )
    offset = 1 if method == "gptq" and qc.get("checkpoint_format", "gptq") == "gptq" else 0
    return Int4Format(method, group, offset)


def _nibbles(words: np.ndarray, order: np.ndarray, axis: int) -> np.ndarray:
    """The 4-bit values of int32 `words`, eight per word, spread along `axis` in `order`
    (value j of a word is its nibble order[j])."""
    u = np.moveaxis(words, axis, -1).astype(np.int64) & 0xFFFFFFFF
    vals = (u[..., None] >> (4 * order)) & 15  # [..., words, 8]
    vals = vals.reshape(*u.shape[:-1], u.shape[-1] * 8).astype(np.int32)
    return np.moveaxis(vals, -1, axis)


@dataclass(frozen=True)
class Unpacked:
    """One linear's values: q [out, in], z and s [groups, out] (float32), group size."""

    q: np.ndarray
    z: np.ndarray
    s: np.ndarray
    group: int

    def rows(self) -> Int4Rows:
        """In Int4Linear's convention: scale s, zero (8 - z) s, repeated to groups of 32."""
        reps = self.group // GROUP
        scale = np.repeat(self.s.T, reps, axis=1)  # [out, in / 32]
        zero = np.repeat(((8 - self.z) * self.s).T, reps, axis=1)
        return Int4Rows(self.q, np.ascontiguousarray(scale), np.ascontiguousarray(zero))

    def dense(self) -> torch.Tensor:
        """The weight [out, in] in float32 by the format's rule, (q - z) * s."""
        n, k = self.q.shape
        zs = (self.q.reshape(n, k // self.group, self.group) - self.z.T[..., None]).astype(
            np.float32
        )
        return torch.from_numpy((zs * self.s.T[..., None]).reshape(n, k))


def unpack_linear(fmt: Int4Format, parts: dict[str, np.ndarray], name: str) -> Unpacked:
    """One linear's packed tensors -> its values; ValueError naming what does not fit."""
    in_order = np.arange(8)
    if fmt.method == "awq":
        q = _nibbles(parts["qweight"], AWQ_NIBBLE, axis=1).T  # [out, in]
        z = _nibbles(parts["qzeros"], AWQ_NIBBLE, axis=1)  # [groups, out]
    else:
        q = _nibbles(parts["qweight"], in_order, axis=0).T
        z = _nibbles(parts["qzeros"], in_order, axis=1) + fmt.zero_offset
    s = parts["scales"].astype(np.float32)  # [groups, out]
    n, k = q.shape
    group = k if fmt.group_size == -1 else fmt.group_size
    if s.shape != (k // group, n) or z.shape != s.shape or k % group:
        raise ValueError(
            f"{name}: qweight {parts['qweight'].shape}, qzeros {parts['qzeros'].shape} and "
            f"scales {parts['scales'].shape} do not fit a {fmt.method.upper()} group_size {group}"
        )
    g_idx = parts.get("g_idx")
    if g_idx is not None and not np.array_equal(g_idx, np.arange(k) // group):
        raise ValueError(f"{name}: g_idx is not in order (act-order checkpoints are not supported)")
    return Unpacked(q, z, s, group)


@dataclass
class Int4Checkpoint:
    """An AWQ or GPTQ folder's tensors (see the module docstring)."""

    fmt: Int4Format
    keep: bool = True
    """Keep each linear's packed parts for `sources` (False: the weights are expanded)."""
    packed: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    """transformers name of a linear's weight -> its packed parts (filled by weights())."""
    packed_bytes: int = 0
    """Bytes of the packed tensors read (qweight, qzeros, scales, g_idx)."""

    def sources(self) -> Int4Sources:
        """The kept linears, each unpacked when its layer is built (layers/quantized.py)."""
        shapes = {}
        for name, parts in self.packed.items():
            a, b = parts["qweight"].shape  # AWQ [in, out / 8], GPTQ [in / 8, out]
            shapes[name] = (b * 8, a) if self.fmt.method == "awq" else (b, a * 8)

        def rows(name: str) -> Int4Rows:
            return unpack_linear(self.fmt, self.packed[name], name).rows()

        return Int4Sources(shapes, rows)

    def weights(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`tensors` (the folder's, as read) with each linear's packed parts replaced by its
        dequantized float32 weight; ValueError naming a linear whose parts are incomplete."""
        packed: dict[str, dict[str, np.ndarray]] = {}
        for name, t in tensors:
            prefix, _, part = name.rpartition(".")
            if part in _PARTS:
                packed.setdefault(prefix, {})[part] = t.numpy()
                self.packed_bytes += t.numel() * t.element_size()
            else:
                yield name, t
        method = self.fmt.method.upper()
        for prefix, parts in packed.items():
            missing = [p for p in _PARTS[:3] if p not in parts]
            if missing:
                raise ValueError(
                    f"{method} checkpoint: {prefix} lacks {', '.join(missing)} (a quantized linear "
                    "has qweight, qzeros and scales)"
                )
            values = unpack_linear(self.fmt, parts, prefix)
            if self.keep and values.group % GROUP == 0:  # (a whole row of any width: expanded)
                self.packed[f"{prefix}.weight"] = parts
            yield f"{prefix}.weight", values.dense()
