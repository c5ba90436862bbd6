"""cpu_paged_attention.cpp built for each instruction set it has a path for (this machine's, which
may be AVX-512, then AVX2 and plain C++), each build against the torch reference backend in a
process of its own: decode (one long sequence split over key blocks too), prefill, a prefill
over a cached prefix and a mixed batch, head dims 64 and 128 (the vector paths) and 96 (the
generic one), float32 and bfloat16 caches, GQA, sliding windows and soft caps. The kernel's own
test (test_cpu_paged.py) runs only the build this machine's CPU gets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.worker.attention import cpu_kernel
from tests.support.isa_build import build_library

ROOT = Path(__file__).parents[3]

CHECK = r"""
import sys
import torch
torch.ops.load_library(sys.argv[1])
from engine.worker.attention import cpu_paged
from engine.worker.attention.cpu_paged import CpuPagedAttentionBackend
from engine.worker.attention.torch_ref import TorchAttentionBackend
from tests.engine.worker.test_attention import random_step
cpu_paged.sdpa_min_queries = lambda cache: cpu_paged.NEVER  # every sequence through the kernel
CASES = {
    "decode": ([10, 33, 64, 0, 5, 200], [1] * 6, 0),
    "decode_one_long": ([700], [1], 0),
    "prefill": ([0, 0, 0], [40, 7, 130], 0),
    "cached_prefix": ([96, 300], [33, 5], 1),
    "mixed": ([0, 20, 45, 3, 16, 0, 129], [37, 1, 13, 1, 16, 1, 70], 3),
}
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
def run(backend, q, k, v, cache, meta, options):
    cache = cache.clone()
    backend.bind_kv_cache(cache.unsqueeze(0), None)
    return backend.forward(q, k, v, cache, meta, q.shape[2] ** -0.5, **options)
checked = 0
for head_dim in (64, 128, 96):
    for dtype in (torch.float32, torch.bfloat16):
        for case, (context, queries, padding) in CASES.items():
            for block_size, heads in ((16, (9, 3)), (8, (6, 1)), (32, (4, 4))):
                for options in ({}, {"sliding_window": 20}, {"logits_soft_cap": 2.0}):
                    key = f"{case}-{heads}-{block_size}-{head_dim}"
                    meta, _, q, k, v, cache = random_step(
                        key, context, queries, padding, heads, block_size, head_dim
                    )
                    q, k, v, cache = (t.to(dtype) for t in (q, k, v, cache))
                    want = run(TorchAttentionBackend(), q, k, v, cache, meta, options)
                    got = run(CpuPagedAttentionBackend(torch.ops.deja_cpu_attn), q, k, v, cache, meta, options)
                    tol = TOL[dtype]
                    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
                    checked += 1
print("ok", checked)
"""


@pytest.mark.parametrize("march", ["native", "haswell", "x86-64"], ids=["native", "avx2", "plain"])
def test_each_instruction_set_path_matches_the_torch_backend(march: str, tmp_path: Path) -> None:
    lib = build_library([cpu_kernel.SOURCE], march, tmp_path / "attention.so")
    ran = subprocess.run(
        [sys.executable, "-c", CHECK, str(lib)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert ran.returncode == 0 and ran.stdout.split()[:2] == ["ok", "270"], ran.stderr[-3000:]
