"""The marks of every GPU test module (`pytestmark = GPU_MARKS`): the `gpu` marker, and a skip
where CUDA is not available."""

from __future__ import annotations

import pytest
import torch

GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]
