"""The marks of every GPU test module (`pytestmark = GPU_MARKS`): the `gpu` marker, and a skip
where CUDA is not available; the engine the GPU tests build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM

GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]


def cupy_llm(path: str | Path, **kwargs: Any) -> LLM:
    """An engine of the checkpoint at `path` on CUDA with the cupy attention backend, in float32
    unless `kwargs` give a dtype."""
    kwargs.setdefault("dtype", "float32")
    return LLM(model=str(path), device="cuda", attention_backend="cupy", **kwargs)
