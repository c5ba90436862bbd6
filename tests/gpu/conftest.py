"""GPU tests: they need CUDA and CuPy and skip cleanly without either.

Each test module also guards itself (pytest.importorskip / skipif), so running one file directly
skips the same way.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch


def gpu_skip_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install -e '.[cuda]')"
    return None


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    reason = gpu_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return torch.device("cuda", torch.cuda.current_device())
