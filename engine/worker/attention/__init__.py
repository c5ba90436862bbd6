"""Attention backends behind one interface (`AttentionBackend`), chosen by a config string."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from engine.worker.attention.base import AttentionBackend, AttentionMetadata
from engine.worker.attention.torch_ref import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "get_attention_backend",
]

BACKEND_NAMES = ("auto", "torch", "cupy")


def _cupy_usable(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and importlib.util.find_spec("cupy") is not None
    )


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """ "torch" -> the reference backend; "cupy" -> the CUDA kernels (imported only when asked);
    "auto" -> cupy on a CUDA device when CuPy is installed, else torch."""
    if name == "auto":
        name = "cupy" if _cupy_usable(device) else "torch"
    if name == "torch":
        return TorchAttentionBackend()
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
