"""Plumbing shared by the kernel loaders: argument checks, lazy CuPy, compile cache, launches.

CuPy is imported only when a kernel is compiled or launched, never at import time, so the loaders
import (and their argument checks run) on machines without CUDA or CuPy. Every check runs before
any CUDA call and raises ValueError.

Kernels are compiled by NVRTC through `cupy.RawModule`, one module per template instantiation
(dtype / head size / block size ...), cached for the life of the process. They run on torch's
current stream and receive raw device pointers (`data_ptr()`), so no tensor is copied or converted.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

CUDA_DIR = Path(__file__).resolve().parent
COMMON_HEADER = "deja_common.cuh"
COMPILE_OPTIONS = ("-std=c++17",)

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "deja::f16",
    torch.bfloat16: "deja::bf16",
    torch.float32: "float",
}
"""C++ element type used in name expressions for each supported torch dtype."""

DTYPES: tuple[torch.dtype, ...] = tuple(DTYPE_NAMES)
"""Every dtype the kernels take (activations and KV cache)."""
FP8 = torch.float8_e4m3fn
"""An fp8 KV cache's dtype: the cache elements are x / scale (engine/worker/attention/kv_quant.py)."""
CACHE_NAMES: dict[torch.dtype, str] = {**DTYPE_NAMES, FP8: "deja::fp8e4m3"}
"""C++ type of the KV cache's elements: the activations' own, or fp8."""


def cache_name(dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """C++ cache element type for activations of `dtype` and a cache of `cache_dtype`."""
    return CACHE_NAMES[cache_dtype if cache_dtype == FP8 else dtype]


ATTENTION_HEAD_SIZES = (64, 96, 128)
"""Head dims both attention kernels (decode and prefill) are instantiated for."""
ATTENTION_BLOCK_SIZES = (16, 32)
"""KV block sizes (tokens per block) both attention kernels are instantiated for."""

LOG2E = 1.4426950408889634
"""The attention kernels run their softmax in the log2 domain (exp2): scores are scaled by it."""

WORD_TYPES: dict[int, str] = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}
"""Machine word of each byte width, for the dtype-agnostic copy kernels."""


def check(cond: bool, msg: str | Callable[[], str]) -> None:
    """ValueError(msg) unless cond. A message that takes formatting is passed as a lambda, so the
    checks cost next to nothing when they pass (they run on every layer's launch)."""
    if not cond:
        raise ValueError(msg if isinstance(msg, str) else msg())


def check_tensor(name: str, t: Any, ndim: int, dtypes: Sequence[torch.dtype]) -> None:
    check(
        isinstance(t, torch.Tensor),
        lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}",
    )
    check(
        t.dim() == ndim, lambda: f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}"
    )
    check(
        t.dtype in dtypes,
        lambda: f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}",
    )


def check_dense_rows(name: str, t: torch.Tensor) -> None:
    """The dims after the first are dense (C order); the first (token) stride may be anything."""
    expected = 1
    for dim in range(t.dim() - 1, 0, -1):
        check(
            t.shape[dim] == 1 or t.stride(dim) == expected,
            lambda: (
                f"{name} must be dense in all dims but the first, got strides {t.stride()} "
                f"for shape {tuple(t.shape)}"
            ),
        )
        expected *= t.shape[dim]


def check_contiguous(name: str, t: torch.Tensor) -> None:
    check(t.is_contiguous(), lambda: f"{name} must be contiguous, got strides {t.stride()}")


def check_aligned(name: str, t: torch.Tensor, row_stride: int, nbytes: int = 16) -> None:
    """Base address and row stride (in elements) allow `nbytes`-wide vector loads."""
    check(
        t.data_ptr() % nbytes == 0 and (row_stride * t.element_size()) % nbytes == 0,
        lambda: (
            f"{name} must be {nbytes}-byte aligned (data_ptr and token stride); "
            "pass a contiguous tensor"
        ),
    )


class AttentionArgs(NamedTuple):
    """The tensors both paged attention kernels (decode and prefill) take."""

    out: torch.Tensor  # [T, Hq, D], dense but for the token stride
    q: torch.Tensor  # [T, Hq, D], like out
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D], one layer
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32

    def cache_pointers(self) -> tuple[np.uint64, ...]:
        """Kernel arguments (q, k_cache, v_cache, block_tables, seq_lens)."""
        kv = self.kv_cache
        return ptr(self.q), ptr(kv[0]), ptr(kv[1]), ptr(self.block_tables), ptr(self.seq_lens)

    def layout(self) -> tuple[np.int64 | np.int32, ...]:
        """Kernel arguments (q_stride, out_stride, num_heads, num_kv_heads, max_blocks)."""
        return (
            np.int64(self.q.stride(0)),
            np.int64(self.out.stride(0)),
            np.int32(self.q.shape[1]),
            np.int32(self.kv_cache.shape[3]),
            np.int32(self.block_tables.shape[1]),
        )


class AttentionDims(NamedTuple):
    num_heads: int  # Hq
    head_dim: int  # D
    block_size: int  # tokens per KV block
    num_kv_heads: int  # Hkv


def attention_configs() -> list[tuple[torch.dtype, int, int]]:
    """Every (dtype, head_dim, block_size) both attention kernels are instantiated for."""
    return list(itertools.product(DTYPES, ATTENTION_HEAD_SIZES, ATTENTION_BLOCK_SIZES))


def attention_supports(head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    """Whether both attention kernels cover this head dim, block size and dtype."""
    return (
        dtype in DTYPES and head_dim in ATTENTION_HEAD_SIZES and block_size in ATTENTION_BLOCK_SIZES
    )


def check_attention_args(args: AttentionArgs) -> AttentionDims:
    """The argument checks both attention loaders share (decode and prefill).

    q, out: [T, Hq, D] of one dtype with the cache, dense but for the token stride;
    kv_cache: [2, NB, BS, Hkv, D] (one layer, contiguous, 16-byte aligned rows); block_tables:
    [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32.
    """
    out, q, kv_cache, block_tables, seq_lens = args
    check_tensor("q", q, 3, DTYPES)
    check_tensor("out", out, 3, DTYPES)
    check_tensor("kv_cache", kv_cache, 5, (*DTYPES, FP8))
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    _, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    check(
        kv_cache.shape[0] == 2,
        lambda: f"kv_cache must be [2, NB, BS, Hkv, D], got {tuple(kv_cache.shape)}",
    )
    check(
        head_dim in ATTENTION_HEAD_SIZES,
        lambda: f"head_dim must be one of {ATTENTION_HEAD_SIZES}, got {head_dim}",
    )
    check(
        block_size in ATTENTION_BLOCK_SIZES,
        lambda: f"block_size must be one of {ATTENTION_BLOCK_SIZES}, got {block_size}",
    )
    check(
        cache_head_dim == head_dim,
        lambda: f"kv_cache head_dim {cache_head_dim} != q head_dim {head_dim}",
    )
    check(
        num_heads % num_kv_heads == 0,
        lambda: f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})",
    )
    check(
        out.shape == q.shape,
        lambda: f"out shape {tuple(out.shape)} must equal q shape {tuple(q.shape)}",
    )
    check(
        q.dtype == out.dtype and kv_cache.dtype in (q.dtype, FP8),
        lambda: (
            f"q, out and kv_cache dtypes differ: {q.dtype}, {out.dtype}, {kv_cache.dtype} "
            "(kv_cache may also be float8_e4m3fn)"
        ),
    )
    check(
        seq_lens.shape[0] <= 65535,
        lambda: f"at most 65535 sequences per launch, got {seq_lens.shape[0]}",
    )
    check_dense_rows("q", q)
    check_dense_rows("out", out)
    check_aligned("q", q, q.stride(0))
    check_contiguous("kv_cache", kv_cache)
    # an fp8 lane reads 16 / q.element_size() bytes at once
    check_aligned(
        "kv_cache", kv_cache, head_dim, 16 // q.element_size() if kv_cache.dtype == FP8 else 16
    )
    check_contiguous("block_tables", block_tables)
    check_contiguous("seq_lens", seq_lens)
    return AttentionDims(num_heads, head_dim, block_size, num_kv_heads)


def check_options(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """The attention options both kernels take: a window >= 1, a soft cap > 0 (None: off)."""
    check(
        sliding_window is None or (isinstance(sliding_window, int) and sliding_window >= 1),
        lambda: f"sliding_window must be an int >= 1 or None, got {sliding_window!r}",
    )
    check(
        logits_soft_cap is None or logits_soft_cap > 0,
        lambda: f"logits_soft_cap must be > 0 or None, got {logits_soft_cap!r}",
    )


def soft_cap_log2(logits_soft_cap: float | None) -> np.float32:
    """The kernels' soft-cap argument: cap * log2(e) (scores are in the log2 domain); 0 = off."""
    return np.float32(0.0 if logits_soft_cap is None else logits_soft_cap * LOG2E)


def check_cuda(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one CUDA device; returns it."""
    devices = {t.device for t in tensors.values()}
    names = ", ".join(tensors)
    check(
        len(devices) == 1, lambda: f"{names} must be on one device, got {sorted(map(str, devices))}"
    )
    device = next(iter(devices))
    check(device.type == "cuda", lambda: f"{names} must be on a CUDA device, got {device}")
    return device


def widest_word(*byte_counts: int) -> int:
    """Largest word size in {16, 8, 4, 2} bytes dividing every size, stride and address given."""
    for width in (16, 8, 4, 2):
        if all(n % width == 0 for n in byte_counts):
            return width
    raise ValueError(f"sizes/addresses {byte_counts} are not 2-byte aligned")


@functools.cache
def import_cupy() -> Any:
    """The cupy module (imported once; the launch path calls this per kernel)."""
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            "CuPy is not installed; install the `cuda` extra (pip install -e '.[cuda]')"
        ) from exc
    return cupy


def kernel_source(cu_file: str) -> str:
    """The .cu source with deja_common.cuh pasted in (so CuPy's on-disk cache key covers it)."""
    common = (CUDA_DIR / COMMON_HEADER).read_text().replace("#pragma once\n", "")
    source = (CUDA_DIR / cu_file).read_text()
    include = f'#include "{COMMON_HEADER}"'
    check(include in source, lambda: f"{cu_file} does not include {COMMON_HEADER}")
    return source.replace(include, common)


@functools.cache
def get_kernel(cu_file: str, name_expression: str) -> Any:
    """Compiles `name_expression` (e.g. "deja::k<float, 64>") from cuda/<cu_file> once."""
    cupy = import_cupy()
    module = cupy.RawModule(
        code=kernel_source(cu_file),
        options=COMPILE_OPTIONS,
        name_expressions=[name_expression],
    )
    return module.get_function(name_expression)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def launch(
    cu_file: str,
    name_expression: str,
    device: torch.device,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    args: tuple[Any, ...],
    shared_mem: int = 0,
) -> None:
    """Launches a kernel on torch's current stream of `device`.

    `args` must match the kernel's C signature exactly: np.uint64 for pointers, np.int32 for int,
    np.int64 for long long, np.float32 for float.
    """
    cupy = import_cupy()
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _external_stream(torch.cuda.current_stream(index).cuda_stream, index)
    with cupy.cuda.Device(index), stream:
        # NOTE: compiled (first call) and loaded with `device` current, for its architecture.
        kernel = get_kernel(cu_file, name_expression)
        kernel(grid, block, args, shared_mem=shared_mem)


@functools.cache
def _external_stream(stream_ptr: int, device_index: int) -> Any:
    """CuPy's view of a torch stream, made once per stream (it only wraps the handle).

    NOTE: CuPy 14 deprecates ExternalStream for Stream.from_external, which needs the
    `__cuda_stream__` protocol that not every torch build has; ExternalStream works on all.
    """
    cupy = import_cupy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(stream_ptr, device_index)
