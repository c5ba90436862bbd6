"""Quantized weights as rows of groups of 32 inputs, in the layers' convention (quantized.py):
GGUF blocks unpacked, and the sources that hand a model's kept tensors to its linears.

`Int4Rows`: w = (q - 8) * scale + zero; `Q8Rows`: w = q * scale. GGUF blocks map onto them
exactly:

- Q4_1 (fp16 d, fp16 m, 32 nibbles q): w = d * q + m, so scale = d, zero = m + 8d;
- Q4_0 (fp16 d, 32 nibbles q): w = d * (q - 8), so scale = d, zero = 0;
- Q4_K (256-weight super-blocks: fp16 d and dmin, eight 6-bit scales sc and mins m, 256 nibbles):
  sub-block j of 32 weights is w = d sc_j q - dmin m_j, so scale = d sc_j, zero = 8 scale -
  dmin m_j (the type most of a Q4_K_M file's linears are in);
- Q8_0 (fp16 d, 32 int8 q): w = d * q (the demo file's tied embedding and LM head);
- Q6_K (256-weight super-blocks: fp16 d, sixteen int8 scales sc, 6-bit q): sub-block j of 16
  weights is w = d sc_j (q - 32), so an 8-bit q - 32 with scale = d sc_j every 16 inputs (the type
  of a Q4_K_M file's LM head and of some of its v and down projections).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from engine.worker.gguf_checkpoint import QuantizedRows

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


class Q8Rows(NamedTuple):
    """A weight in 8-bit groups of 32 inputs: w = q * scale (GGUF's Q8_0); or with a scale every
    16 inputs (Q6_K)."""

    q: np.ndarray
    """int8 [N, K]."""
    scale: np.ndarray
    """float32 [N, K / 32], or [N, K / 16]."""


def unpack_q8_0(rows: QuantizedRows) -> Q8Rows:
    """A Q8_0 weight's rows (blocks of fp16 d and 32 int8)."""
    n, k = rows.shape
    blocks = rows.blocks.reshape(n, k // GROUP, 2 + GROUP)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return Q8Rows(q, _fp16(blocks, 0))


def unpack_q6_k(rows: QuantizedRows) -> Q8Rows:
    """A Q6_K weight (super-blocks of 256: 128 bytes of low 4 bits, 64 of high 2 bits, sixteen
    int8 scales, fp16 d; 210 bytes) as q - 32 in int8 with scale d sc_j every 16 inputs. The q
    values come from gguf's own dequantization of the blocks with every scale and d set to 1."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    n, k = rows.shape
    blocks = rows.blocks.reshape(n * k // 256, 210)
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # [blocks, 16]
    d = _fp16(blocks, 208)[:, None]
    ones = blocks.copy()
    ones[:, 192:208] = 1
    ones[:, 208:210] = np.array([1.0], dtype=np.float16).view(np.uint8)
    q = quants.dequantize(ones, T.Q6_K).reshape(n, k)  # q - 32, exact in float32
    return Q8Rows(q.astype(np.int8), (d * sc).reshape(n, k // 16))


INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
"""GGUF types whose linears stay 4-bit (Int4Linear)."""
KEPT_TYPES = (*INT4_TYPES, "Q8_0", "Q6_K")
"""GGUF types whose linears stay quantized (Q8_0 and Q6_K as a Q8Linear); the others are
expanded."""


@dataclass(frozen=True)
class Int4Sources:
    """Weights that can become quantized linears: each one's shape [out, in] by transformers
    name, and how to unpack it, called for the ones a linear takes, one at a time (an unpacked
    weight is ~4 bytes a weight: never all of them at once)."""

    shapes: Mapping[str, tuple[int, int]]
    unpack: Callable[[str], Int4Rows | Q8Rows]

    def sliced(self, slices: Mapping[str, tuple[int, int, int] | None]) -> Int4Sources:
        """This tensor-parallel rank's parts (`slices` as model_loader.iter_weights takes them:
        name -> (dim, start, length), None for none, absent for all): output rows as they are,
        inputs where the part is whole groups of 32 (else the weight is left out: expanded)."""
        shapes: dict[str, tuple[int, int]] = {}
        for name, (n, k) in self.shapes.items():
            if name not in slices:
                shapes[name] = (n, k)
                continue
            part = slices[name]
            if part is None or (part[0] == 1 and (part[1] % GROUP or part[2] % GROUP)):
                continue
            shapes[name] = (part[2], k) if part[0] == 0 else (n, part[2])

        def rows(name: str) -> Int4Rows | Q8Rows:
            whole = self.unpack(name)
            if name not in slices:
                return whole
            dim, start, length = slices[name] or (0, 0, 0)
            per = whole.q.shape[1] // whole.scale.shape[1]  # inputs a scale covers (32 or 16)
            parts = [
                np.ascontiguousarray(
                    a[start : start + length]
                    if dim == 0
                    else a[:, (start // step) : (start + length) // step]
                )
                for a, step in zip(whole, (1, per, per), strict=False)
            ]
            return type(whole)(*parts)

        return Int4Sources(shapes, rows)


def gguf_int4(quantized: Mapping[str, QuantizedRows]) -> Int4Sources:
    """The kept tensors (KEPT_TYPES) of a GGUF file's quantized ones."""
    shapes = {n: r.shape for n, r in quantized.items() if r.kind.name in KEPT_TYPES}

    def rows(name: str) -> Int4Rows | Q8Rows:
        r = quantized[name]
        if r.kind.name == "Q6_K":
            return unpack_q6_k(r)
        return unpack_q8_0(r) if r.kind.name == "Q8_0" else unpack(r)

    return Int4Sources(shapes, rows)
