"""AWQ and GPTQ int4 folders made from a float checkpoint, packed by the formats' documented rules
(AutoAWQ's WQLinear_GEMM.pack, AutoGPTQ's QuantLinear.pack), plus the folder of the same weights
dequantized: the reference transformers loads. Round-to-nearest, asymmetric, fp16 scales.

Written from the packing side on purpose: deja's reader (engine/worker/int4_checkpoint.py)
unpacks, so a test of one against the other checks both directions of the layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
"""AutoAWQ's pack order: nibble i of a word holds column AWQ_ORDER[i] of its eight."""


def _quantize(w: np.ndarray, group: int, min_zero: int) -> tuple[np.ndarray, ...]:
    """w [N, K] -> (q [N, K], z [N, G], s fp16 [N, G], dequantized [N, K] float32)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    s = np.maximum((hi - lo) / 15, 1e-6).astype(np.float16)
    s32 = s.astype(np.float32)
    z = np.clip(np.round(-lo / s32), min_zero, 15).astype(np.int64)
    q = np.clip(np.round(g / s32[..., None]) + z[..., None], 0, 15).astype(np.int64)
    dense = ((q - z[..., None]).astype(np.float32) * s32[..., None]).reshape(n, k)
    return q.reshape(n, k), z, s, dense


def _pack(vals: np.ndarray, order: list[int]) -> np.ndarray:
    """[R, C] 4-bit values -> int32 [R, C / 8]: word c holds columns 8c.. with nibble i =
    column 8c + order[i]."""
    r, c = vals.shape
    v = vals.reshape(r, c // 8, 8)
    words = np.zeros((r, c // 8), dtype=np.uint64)
    for i, col in enumerate(order):
        words |= (v[..., col].astype(np.uint64) & 15) << np.uint64(4 * i)
    return words.astype(np.uint32).view(np.int32)


def is_quantized(name: str) -> bool:
    """The tensors written packed: the attention and MLP projections."""
    return name.endswith("_proj.weight") and ".layers." in name


def write_int4(
    src: str | Path, dst: str | Path, method: str, group_size: int, checkpoint_format: str = "gptq"
) -> tuple[Path, Path]:
    """(the packed folder, the dequantized reference folder) made from the float folder `src`.
    method: awq or gptq; group_size: inputs a scale covers (-1: the whole input)."""
    from safetensors.numpy import load_file, save_file

    src, dst = Path(src), Path(dst)
    packed_dir, ref_dir = dst / method, dst / f"{method}-dequantized"
    for d in (packed_dir, ref_dir):
        shutil.copytree(src, d, dirs_exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    packed: dict[str, np.ndarray] = {}
    ref: dict[str, np.ndarray] = {}
    offset = 1 if method == "gptq" and checkpoint_format == "gptq" else 0
    for name, w in tensors.items():
        if not is_quantized(name):
            packed[name] = ref[name] = w
            continue
        k = w.shape[1]
        group = k if group_size == -1 else group_size
        q, z, s, dense = _quantize(w.astype(np.float32), group, min_zero=offset)
        prefix = name.removesuffix(".weight")
        ref[name] = dense
        if method == "awq":
            packed[f"{prefix}.qweight"] = _pack(q.T, AWQ_ORDER)  # [K, N / 8]
            packed[f"{prefix}.qzeros"] = _pack(z.T, AWQ_ORDER)  # [G, N / 8]
        else:
            packed[f"{prefix}.qweight"] = np.ascontiguousarray(_pack(q, list(range(8))).T)
            packed[f"{prefix}.qzeros"] = _pack(z.T - offset, list(range(8)))
            packed[f"{prefix}.g_idx"] = (np.arange(k) // group).astype(np.int32)
        packed[f"{prefix}.scales"] = np.ascontiguousarray(s.T)  # [G, N] fp16
    save_file(packed, str(packed_dir / "model.safetensors"))
    save_file(ref, str(ref_dir / "model.safetensors"))
    config = json.loads((packed_dir / "config.json").read_text())
    qc: dict[str, object] = {"quant_method": method, "bits": 4, "group_size": group_size}
    if method == "awq":
        qc.update(version="gemm", zero_point=True)
    else:
        qc.update(desc_act=False, sym=False, checkpoint_format=checkpoint_format)
    config["quantization_config"] = qc
    (packed_dir / "config.json").write_text(json.dumps(config, indent=2))
    return packed_dir, ref_dir
