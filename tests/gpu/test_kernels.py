"""Every CUDA kernel on a GPU against a float64 reference and the torch reference backend.

Grid: every (dtype, head size, block size) the attention kernels are built for
(cuda.cupy_launch.attention_configs), GQA ratios 1 / 4 / 8 (and 3, which uses several CTAs per KV
head), random block tables, ragged lengths, padding slots, and a cache whose unused slots hold NaN
(a kernel that reads one fails).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.gpu import GPU_MARKS

pytest.importorskip("cupy")
pytestmark = GPU_MARKS

from cuda import block_copy, paged_attention, reshape_and_cache  # noqa: E402
from cuda.cupy_launch import DTYPES, attention_configs  # noqa: E402
from engine.worker.attention.cupy_backend import CupyAttentionBackend  # noqa: E402
from engine.worker.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from tests.support import kernel_reference as kref  # noqa: E402
from tests.support.attention import make_attention_metadata  # noqa: E402

HEADS = [(8, 8), (16, 4), (16, 2), (12, 4)]  # GQA ratios 1, 4, 8, 3
GRID = [(*cfg, heads) for cfg in attention_configs() for heads in HEADS]


def _id(cfg: tuple[torch.dtype, int, int, tuple[int, int]]) -> str:
    dtype, d, bs, (hq, hkv) = cfg
    return f"{str(dtype).removeprefix('torch.')}-d{d}-bs{bs}-h{hq}/{hkv}"


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double().cpu() - ref).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(cuda_device: torch.device, dtype: torch.dtype) -> None:
    case = kref.make_case(
        [5, 0, 33], [3, 17, 1], 8, 2, 128, 16, dtype, cuda_device, num_padding_tokens=4
    )
    expected = kref.write_reference(case)
    cache = case.kv_cache.clone()
    reshape_and_cache.reshape_and_cache(case.k, case.v, cache, case.slot_mapping)
    torch.cuda.synchronize()
    assert torch.equal(cache.isnan(), expected.isnan())
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("split", [False, True], ids=["plain", "split-k"])
@pytest.mark.parametrize("cfg", GRID, ids=_id)
def test_decode(
    cuda_device: torch.device, cfg: tuple[torch.dtype, int, int, tuple[int, int]], split: bool
) -> None:
    dtype, d, bs, (hq, hkv) = cfg
    contexts = [0, 15, 16, 100, 1300, 2047] if split else [0, 15, 16, 33, 100, 257]
    case = kref.make_case(
        contexts, [1] * len(contexts), hq, hkv, d, bs, dtype, cuda_device, seed=d + bs
    )
    cache = kref.write_reference(case)
    scale = 1 / math.sqrt(d)
    out = kref.run_decode(case, cache, scale, split)
    torch.cuda.synchronize()
    err = _err(out, kref.attention_reference(case, cache, scale))
    assert err < kref.tolerance(dtype), err


@pytest.mark.parametrize("cfg", GRID, ids=_id)
def test_prefill(
    cuda_device: torch.device, cfg: tuple[torch.dtype, int, int, tuple[int, int]]
) -> None:
    dtype, d, bs, (hq, hkv) = cfg
    # fresh prompt, chunk over a cached prefix, decode token, long chunk, chunk over long prefix
    contexts, queries = [0, 21, 40, 3, 700], [19, 12, 1, 150, 37]
    case = kref.make_case(
        contexts, queries, hq, hkv, d, bs, dtype, cuda_device, num_padding_tokens=3
    )
    cache = kref.write_reference(case)
    scale = 1 / math.sqrt(d)
    out = kref.run_prefill(case, cache, scale)
    torch.cuda.synchronize()
    n = case.num_queries
    err = _err(out[:n], kref.attention_reference(case, cache, scale))
    assert err < kref.tolerance(dtype), err
    assert out[n:].isnan().all()


WINDOW_OPTIONS = [(1, None), (100, None), (600, None), (None, 1.0), (64, 0.5)]
"""(sliding window, logit soft cap) of the window tests; blocks wholly before each sequence's
window hold NaN (as a block the KV manager released may)."""


@pytest.mark.parametrize("options", WINDOW_OPTIONS, ids=str)
@pytest.mark.parametrize("split", [False, True], ids=["plain", "split-k"])
@pytest.mark.parametrize("cfg", GRID[::5], ids=_id)
def test_decode_window_and_soft_cap(
    cuda_device: torch.device,
    cfg: tuple[torch.dtype, int, int, tuple[int, int]],
    split: bool,
    options: tuple[int | None, float | None],
) -> None:
    window, soft_cap = options
    dtype, d, bs, (hq, hkv) = cfg
    contexts = [0, 15, 16, 100, 1300, 2047]
    case = kref.make_case(
        contexts, [1] * 6, hq, hkv, d, bs, dtype, cuda_device, seed=d + bs, window=window
    )
    cache = kref.write_reference(case)
    scale = 1.5 / math.sqrt(d)
    out = kref.run_decode(case, cache, scale, split, window=window, soft_cap=soft_cap)
    torch.cuda.synchronize()
    ref = kref.attention_reference(case, cache, scale, window=window, soft_cap=soft_cap)
    assert _err(out, ref) < kref.tolerance(dtype)


@pytest.mark.parametrize("options", WINDOW_OPTIONS, ids=str)
@pytest.mark.parametrize("cfg", GRID[::5], ids=_id)
def test_prefill_window_and_soft_cap(
    cuda_device: torch.device,
    cfg: tuple[torch.dtype, int, int, tuple[int, int]],
    options: tuple[int | None, float | None],
) -> None:
    window, soft_cap = options
    dtype, d, bs, (hq, hkv) = cfg
    contexts, queries = [0, 21, 40, 3, 700], [19, 12, 1, 150, 37]
    case = kref.make_case(
        contexts, queries, hq, hkv, d, bs, dtype, cuda_device, num_padding_tokens=3, window=window
    )
    cache = kref.write_reference(case)
    scale = 1.5 / math.sqrt(d)
    out = kref.run_prefill(case, cache, scale, window=window, soft_cap=soft_cap)
    torch.cuda.synchronize()
    n = case.num_queries
    ref = kref.attention_reference(case, cache, scale, window=window, soft_cap=soft_cap)
    assert _err(out[:n], ref) < kref.tolerance(dtype)
    assert out[n:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "contexts,queries,padding",
    [
        ([5, 0, 40, 17, 900], [1, 1, 1, 1, 1], 0),
        ([5, 0, 40, 17, 900], [1, 9, 1, 20, 64], 0),
        ([0, 33], [16, 1], 3),
    ],
    ids=["decode", "mixed", "padding"],
)
def test_backend_matches_torch_backend(
    cuda_device: torch.device,
    dtype: torch.dtype,
    contexts: list[int],
    queries: list[int],
    padding: int,
) -> None:
    case = kref.make_case(
        contexts, queries, 32, 8, 128, 16, dtype, cuda_device, num_padding_tokens=padding
    )
    cache = case.kv_cache.nan_to_num()
    meta, _ = make_attention_metadata(
        contexts, queries, case.block_tables.tolist(), 16, padding, device=str(cuda_device)
    )
    scale = 1 / math.sqrt(128)
    ours_cache, ref_cache = cache.clone(), cache.clone()
    ours = CupyAttentionBackend(cuda_device).forward(
        case.q, case.k, case.v, ours_cache, meta, scale
    )
    ref = TorchAttentionBackend().forward(case.q, case.k, case.v, ref_cache, meta, scale)
    torch.cuda.synchronize()
    assert torch.equal(ours_cache, ref_cache)
    err = (ours.double() - ref.double()).abs().max().item()
    assert err < 2 * kref.tolerance(dtype), err


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_copies(cuda_device: torch.device, dtype: torch.dtype) -> None:
    cache = torch.randn(4, 2, 20, 16, 2, 96, device=cuda_device).to(dtype)
    src = torch.tensor([0, 7, 8, 19], device=cuda_device)
    dst = torch.tensor([3, 1, 12, 5], device=cuda_device)
    expected = cache.clone()
    expected[:, :, dst] = expected[:, :, src]
    block_copy.copy_blocks(cache, src, dst)
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)

    ids = torch.tensor([11, 2, 19], device=cuda_device)
    staging = torch.empty(4, 2, 3, 16, 2, 96, dtype=dtype, device=cuda_device)
    block_copy.gather_blocks(cache, ids, staging)
    torch.cuda.synchronize()
    assert torch.equal(staging, cache[:, :, ids])
    new = torch.randn(staging.shape, device=cuda_device).to(dtype)
    expected = cache.clone()
    expected[:, :, ids] = new
    block_copy.scatter_blocks(new, cache, ids)
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)


def test_runs_on_torch_current_stream(cuda_device: torch.device) -> None:
    """A kernel launched under a side stream is ordered after that stream's earlier work."""
    case = kref.make_case([300], [1], 8, 2, 128, 16, torch.bfloat16, cuda_device)
    cache = kref.write_reference(case)
    stream = torch.cuda.Stream(cuda_device)
    out = torch.zeros_like(case.q)
    stream.wait_stream(torch.cuda.current_stream(cuda_device))
    with torch.cuda.stream(stream):
        q = case.q * 1.0  # produced on `stream`
        paged_attention.paged_decode_attention(
            out, q, cache, case.block_tables, case.seq_lens, 0.1, case.max_seq_len
        )
    torch.cuda.current_stream(cuda_device).wait_stream(stream)
    torch.cuda.synchronize()
    err = _err(out, kref.attention_reference(case, cache, 0.1))
    assert err < kref.tolerance(torch.bfloat16), err
