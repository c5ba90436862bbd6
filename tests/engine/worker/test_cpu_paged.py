"""The C++ CPU paged-attention kernel (cpu_paged.py) against the torch reference backend.

Random paged caches (shuffled block tables, random values in every slot), ragged lengths,
decode, prefill, prefill over a cached prefix, GQA, float32 / bfloat16 / fp8 caches, several
block sizes, sliding windows and soft caps. Skips, with the reason, where the kernel cannot be
built (no compiler): the engine then runs the torch backend.
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine.worker.attention import (
    AttentionBackend,
    AttentionMetadata,
    cpu_paged,
    get_attention_backend,
)
from engine.worker.attention.cpu_kernel import load_kernel
from engine.worker.attention.cpu_paged import CpuPagedAttentionBackend
from engine.worker.attention.kv_quant import FP8_DTYPE, KVScales
from engine.worker.attention.torch_ref import TorchAttentionBackend
from tests.engine.worker.test_attention import random_step

torch.set_num_threads(2)

KERNEL = load_kernel()
pytestmark = pytest.mark.skipif(
    KERNEL.ops is None, reason=f"CPU attention kernel not built: {KERNEL.reason}"
)

# (context lens, query lens, padding tokens)
CASES = {
    "decode": ([10, 33, 64, 0, 5, 200], [1] * 6, 0),
    "decode_one_long": ([700], [1], 0),  # split over key blocks (flash-decoding)
    "prefill": ([0, 0, 0], [40, 7, 130], 0),
    "cached_prefix": ([96, 300], [33, 5], 1),
    "mixed": ([0, 20, 45, 3, 16, 0, 129], [37, 1, 13, 1, 16, 1, 70], 3),
    # one chunk of many rows over a long context: too few items for the threads, so split over
    # key blocks and merged (the many-row path's parts)
    "chunk_one_long": ([300], [12], 0),
}
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _batch(
    case: str, heads: tuple[int, int], block_size: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    context_lens, query_lens, padding = CASES[case]
    key = f"{case}-{heads}-{block_size}-{head_dim}"
    meta, _, q, k, v, cache = random_step(
        key, context_lens, query_lens, padding, heads, block_size, head_dim
    )
    q, k, v, cache = (t.to(dtype) for t in (q, k, v, cache))
    return q, k, v, cache, meta


def _run(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    cache = cache.clone()
    backend.bind_kv_cache(cache.unsqueeze(0), None)
    out = backend.forward(q, k, v, cache, meta, q.shape[2] ** -0.5)
    return out, cache


@pytest.mark.parametrize("route", ["kernel", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (6, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_torch_backend(
    case: str,
    block_size: int,
    heads: tuple[int, int],
    dtype: torch.dtype,
    route: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """route "kernel": every sequence through the kernel (the default where its vector path
    takes the cache); "split": long prefill chunks by SDPA over their own blocks (the default
    elsewhere), the rest by the kernel."""
    bound = cpu_paged.NEVER if route == "kernel" else cpu_paged.SDPA_MIN_QUERIES
    monkeypatch.setattr(cpu_paged, "sdpa_min_queries", lambda cache: bound)
    q, k, v, cache, meta = _batch(case, heads, block_size, 64, dtype)
    want, want_cache = _run(TorchAttentionBackend(), q, k, v, cache, meta)
    got, got_cache = _run(CpuPagedAttentionBackend(KERNEL.ops), q, k, v, cache, meta)
    assert torch.equal(got_cache, want_cache)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    num_queries = sum(meta.query_lens_cpu)
    assert not got[num_queries:].any()  # padding tokens get zeros


@pytest.mark.parametrize(
    "layout",
    [(32, torch.float32), (64, torch.float32), (64, torch.bfloat16)],
    ids=lambda x: f"d{x[0]}-{x[1]}",
)
@pytest.mark.parametrize("options", [(1, None), (20, None), (None, 2.0), (40, 1.5)])
@pytest.mark.parametrize("case", ["decode", "cached_prefix", "mixed", "chunk_one_long"])
def test_kernel_window_and_soft_cap(
    case: str, options: tuple[int | None, float | None], layout: tuple[int, torch.dtype]
) -> None:
    """Head dim 32 takes the scalar path; 64 the vector ones (the many-row path for chunks)."""
    window, cap = options
    head_dim, dtype = layout
    q, k, v, cache, meta = _batch(case, (4, 2), 16, head_dim, dtype)
    outs = []
    for backend in (TorchAttentionBackend(), CpuPagedAttentionBackend(KERNEL.ops)):
        c = cache.clone()
        backend.bind_kv_cache(c.unsqueeze(0), None)
        outs.append(
            backend.forward(
                q, k, v, c, meta, head_dim**-0.5, sliding_window=window, logits_soft_cap=cap
            )
        )
    tol = TOL[dtype]
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)


def test_window_never_reads_released_blocks() -> None:
    """Blocks wholly before every query's window may be placeholders: NaN there changes nothing."""
    q, k, v, cache, meta = _batch("cached_prefix", (4, 2), 16, 32, torch.float32)
    window = 24
    backend = CpuPagedAttentionBackend(KERNEL.ops)
    clean = cache.clone()
    backend.bind_kv_cache(clean.unsqueeze(0), None)
    want = backend.forward(q, k, v, clean, meta, 0.2, sliding_window=window)
    dirty = cache.clone()
    tables = meta.block_tables.tolist()
    for seq_len, qlen, table in zip(meta.seq_lens_cpu, meta.query_lens_cpu, tables, strict=True):
        first_pos = seq_len - qlen
        for b in range(max(0, first_pos - window + 1) // 16):
            dirty[:, table[b]] = float("nan")
    backend.bind_kv_cache(dirty.unsqueeze(0), None)
    got = backend.forward(q, k, v, dirty, meta, 0.2, sliding_window=window)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["decode", "mixed", "cached_prefix"])
def test_kernel_fp8_cache(case: str, dtype: torch.dtype) -> None:
    q, k, v, cache, meta = _batch(case, (9, 3), 16, 64, dtype)
    cache8 = (cache.float() / 4).clamp(-448, 448).to(FP8_DTYPE)
    scales = KVScales((0.25,), (0.5,))
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), CpuPagedAttentionBackend(KERNEL.ops)):
        c = cache8.clone()
        backend.bind_kv_cache(c.unsqueeze(0), scales)
        outs.append(backend.forward(q, k, v, c, meta, 0.125))
        caches.append(c)
    assert torch.equal(caches[1].view(torch.uint8), caches[0].view(torch.uint8))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_unsupported_layers_fall_back_to_torch(caplog: pytest.LogCaptureFixture) -> None:
    q, k, v, cache, meta = _batch("mixed", (4, 2), 16, 32, torch.float16)
    backend = CpuPagedAttentionBackend(KERNEL.ops)
    with caplog.at_level(logging.WARNING):
        got, _ = _run(backend, q, k, v, cache, meta)
        _run(backend, q, k, v, cache, meta)
    want, _ = _run(TorchAttentionBackend(), q, k, v, cache, meta)
    assert torch.equal(got, want)
    assert backend.fallback_reasons == {"dtype torch.float16"}
    assert sum("torch attention for it" in r.message for r in caplog.records) == 1


def test_auto_picks_the_kernel_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert get_attention_backend("auto", cpu).name == "cpu"
    assert get_attention_backend("cpu", cpu).name == "cpu"
    assert get_attention_backend("torch", cpu).name == "torch"


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("avx2", [False, True])
def test_prefill_chunks_go_to_sdpa_only_where_the_kernel_is_slower(
    amx: bool, avx2: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks stay with the kernel where its vector path takes the cache, except bfloat16 on a
    CPU with AMX (SDPA on AMX tiles); an fp8 cache or another head dim (the scalar path) and a
    CPU without AVX2 send them to SDPA."""
    monkeypatch.setattr(cpu_paged, "has_amx_bf16", lambda: amx)
    monkeypatch.setattr(cpu_paged, "has_avx2_fma", lambda: avx2)

    def bound(dtype: torch.dtype, head_dim: int = 64) -> int:
        return cpu_paged.sdpa_min_queries(torch.zeros(1, 2, 4, 16, 2, head_dim, dtype=dtype))

    kernel, sdpa = cpu_paged.NEVER, cpu_paged.SDPA_MIN_QUERIES
    assert bound(torch.float32) == (kernel if avx2 else sdpa)
    assert bound(torch.float32, 128) == (kernel if avx2 else sdpa)
    assert bound(torch.bfloat16) == (kernel if avx2 and not amx else sdpa)
    assert bound(torch.float32, 96) == sdpa
    assert bound(torch.float8_e4m3fn) == sdpa
    backend = CpuPagedAttentionBackend(KERNEL.ops)
    backend.bind_kv_cache(torch.zeros(1, 2, 4, 16, 2, 64), None)
    assert backend.sdpa_min_queries == bound(torch.float32)
