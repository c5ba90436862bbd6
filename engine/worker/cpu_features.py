"""What the host can do, for choices made once at start-up (the device, the default dtype).

Read from /proc/cpuinfo (Linux); elsewhere nothing is known and the choices fall back to the
safe side (float32).
"""

from __future__ import annotations

from functools import cache

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags of bfloat16 arithmetic units that oneDNN's bf16 kernels use (AVX-512 BF16, AMX)."""


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_bf16_units() -> bool:
    """The CPU computes in bfloat16 natively (without it, bf16 is emulated and slower than fp32)."""
    return any(flag in cpu_flags() for flag in BF16_FLAGS)


def has_amx_bf16() -> bool:
    """The CPU has AMX tiles with bfloat16 products (Intel Sapphire Rapids and later)."""
    return "amx_bf16" in cpu_flags()


def has_avx2_fma() -> bool:
    """The CPU has AVX2 and FMA (the C++ kernels' vector paths need at least these)."""
    return {"avx2", "fma"} <= cpu_flags()


def resolve_dtype(name: str, device_type: str) -> str:
    """'auto' -> bfloat16 on a GPU and on a CPU with bf16 units, else float32; others as given."""
    if name != "auto":
        return name
    if device_type == "cuda" or has_bf16_units():
        return "bfloat16"
    return "float32"


def resolve_device(name: str) -> torch.device:
    """auto: cuda when available, else cpu; ValueError for cuda without CUDA."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available; use --device cpu")
    return torch.device(name)
