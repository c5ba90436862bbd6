"""Attention backends behind one interface (`AttentionBackend`), chosen by a config string."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from engine.worker.attention.base import AttentionBackend, AttentionMetadata
from engine.worker.attention.cpu_kernel import load_kernel
from engine.worker.attention.cpu_paged import CpuPagedAttentionBackend
from engine.worker.attention.torch_ref import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuPagedAttentionBackend",
    "TorchAttentionBackend",
    "get_attention_backend",
]

BACKEND_NAMES = ("auto", "torch", "cupy", "cpu")


def _cupy_usable(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and importlib.util.find_spec("cupy") is not None
    )


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """ "torch" -> the reference backend; "cupy" -> the CUDA kernels (imported only when asked);
    "cpu" -> the C++ CPU paged-attention kernel (built on first use, cached per machine);
    "auto" -> cupy on a CUDA device when CuPy is installed; on the CPU the C++ kernel when it
    builds and loads (else torch, with the reason logged once)."""
    if name == "auto":
        if device.type == "cuda":
            name = "cupy" if _cupy_usable(device) else "torch"
        else:
            name = "cpu" if load_kernel().ops is not None else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on the CPU, got {device}")
        kernel = load_kernel()
        if kernel.ops is None:
            raise ValueError(f"attention backend 'cpu' is not available: {kernel.reason}")
        return CpuPagedAttentionBackend(kernel.ops)
    if name == "cupy":
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(
                f"attention backend 'cupy' needs a CUDA device, got {device} "
                f"(CUDA available: {torch.cuda.is_available()}); use 'torch' or 'auto'"
            )
        if importlib.util.find_spec("cupy") is None:
            raise ValueError(
                "attention backend 'cupy' needs CuPy (`pip install cupy-cuda12x`); "
                "use 'torch' or 'auto'"
            )
        module = importlib.import_module("engine.worker.attention.cupy_backend")
        backend: AttentionBackend = module.CupyAttentionBackend()
        return backend
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
