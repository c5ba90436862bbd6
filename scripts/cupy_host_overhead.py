"""The host (Python) cost of the cupy attention backend's per-layer call, with no GPU: the
loaders' launches and device checks are stubbed out, so what is timed is the argument checks,
the launch planning and the argument lists of one decode layer (cache write + attention) and of
the layer kernels (cuda/layers.py).

    python scripts/cupy_host_overhead.py [--seqs 64] [--calls 2000]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from cuda import layers, paged_attention, prefill_attention, reshape_and_cache
from engine.worker.attention.base import AttentionMetadata
from engine.worker.attention.cupy_backend import CupyAttentionBackend


def _stub_launches() -> None:
    def launch(*args: Any, **kwargs: Any) -> None:
        return None

    def on_cpu(**tensors: torch.Tensor) -> torch.device:
        return torch.device("cpu")

    for module in (paged_attention, prefill_attention, reshape_and_cache, layers):
        module.launch = launch  # type: ignore[assignment]
        module.check_cuda = on_cpu  # type: ignore[assignment]
    paged_attention.num_sms = lambda device: 132  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=64, help="decode batch")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    _stub_launches()
    backend = object.__new__(CupyAttentionBackend)  # the constructor insists on CUDA
    backend._setup(torch.device("cpu"), fallback=False)
    n, heads, kv_heads, dim, bs = args.seqs, 32, 8, 64, 16  # Llama-3.2-1B's attention
    kv = torch.zeros(2, 2, 512, bs, kv_heads, dim, dtype=torch.bfloat16)
    backend.bind_kv_cache(kv, None)
    q = torch.randn(n, heads, dim, dtype=torch.bfloat16)
    k = torch.randn(n, kv_heads, dim, dtype=torch.bfloat16)
    lens = [300] * n
    meta = AttentionMetadata(
        torch.arange(n, dtype=torch.int64),
        torch.arange(n + 1, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.zeros(n, 32, dtype=torch.int32),
        [1] * n,
        lens,
        1,
        300,
    )
    x = q.view(n, -1)
    w = torch.ones(heads * dim, dtype=torch.bfloat16)
    cases = {
        "decode layer (cache write + attention)": lambda: backend.forward(
            q, k, k, kv[1], meta, 0.125
        ),
        "rms_norm": lambda: layers.rms_norm(x, w, 1e-5),
        "add_rms_norm": lambda: layers.add_rms_norm(x, x, w, 1e-5),
        "rope": lambda: layers.rope(q, q[:, :1, :32], q[:, :1, 32:]),
    }
    for name, call in cases.items():
        for _ in range(args.calls // 10):
            call()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        us = (time.perf_counter() - start) / args.calls * 1e6
        print(f"{name}: {us:.1f} us a call")


if __name__ == "__main__":
    main()
