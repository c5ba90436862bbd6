"""Loader of block_copy.cu: whole-block copies over every layer in one launch.

- copy_blocks: cache[:, :, dst[i]] = cache[:, :, src[i]] (copy-on-write, device-side staging).
- gather_blocks / scatter_blocks: between the cache and a contiguous staging buffer shaped like
  `cache[:, :, ids]`, which one async copy then moves to or from pinned host memory (CPU tier).
"""

from __future__ import annotations

import numpy as np
import torch

from cuda.cupy_launch import (
    DTYPES,
    FP8,
    WORD_TYPES,
    check,
    check_contiguous,
    check_cuda,
    check_tensor,
    launch,
    ptr,
    widest_word,
)

CU_FILE = "block_copy.cu"
THREADS = 256


def copy_kernel_name(word_bytes: int) -> str:
    return f"deja::copy_blocks_kernel<{WORD_TYPES[word_bytes]}>"


def gather_scatter_kernel_name(word_bytes: int, scatter: bool) -> str:
    flag = "true" if scatter else "false"
    return f"deja::gather_scatter_blocks_kernel<{WORD_TYPES[word_bytes]}, {flag}>"


def instantiations() -> list[str]:
    """Every name expression this loader may compile (the CI compile check builds them all)."""
    names = [copy_kernel_name(w) for w in WORD_TYPES]
    names += [gather_scatter_kernel_name(w, s) for w in WORD_TYPES for s in (False, True)]
    return names


def _check_cache(kv_cache: torch.Tensor) -> None:
    check_tensor("kv_cache", kv_cache, 6, (*DTYPES, FP8))  # bytes are bytes: fp8 too
    check(
        kv_cache.shape[1] == 2,
        f"kv_cache must be [num_layers, 2, num_blocks, block_size, Hkv, D], "
        f"got {tuple(kv_cache.shape)}",
    )
    check_contiguous("kv_cache", kv_cache)


def _check_ids(name: str, ids: torch.Tensor) -> None:
    check_tensor(name, ids, 1, (torch.int64,))
    check_contiguous(name, ids)


def _block_word(kv_cache: torch.Tensor, *others: torch.Tensor) -> tuple[int, int]:
    """(word bytes, words per block) for copying whole blocks of kv_cache."""
    block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    width = widest_word(block_bytes, kv_cache.data_ptr(), *(t.data_ptr() for t in others))
    return width, block_bytes // width


def _launch(
    name: str,
    device: torch.device,
    kv_cache: torch.Tensor,
    tensors: tuple[torch.Tensor, torch.Tensor],
    num_ids: int,
    *sizes: int,
) -> None:
    """One CTA per (listed block, layer plane); the kernel takes (kv_cache, *tensors, num_blocks,
    *sizes) with the sizes as long long."""
    launch(
        CU_FILE,
        name,
        device,
        grid=(num_ids, kv_cache.shape[0] * 2, 1),
        block=(THREADS, 1, 1),
        args=(
            ptr(kv_cache),
            *(ptr(t) for t in tensors),
            np.int64(kv_cache.shape[2]),
            *(np.int64(n) for n in sizes),
        ),
    )


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies block src[i] to dst[i] in every layer, K and V.

    kv_cache: [num_layers, 2, num_blocks, block_size, Hkv, D] contiguous.
    src, dst: [n] int64 on the cache's device. NOTE: no block may be both a source and a
    destination, and destinations must be distinct; ids outside [0, num_blocks) are skipped.
    """
    _check_cache(kv_cache)
    _check_ids("src", src)
    _check_ids("dst", dst)
    check(src.shape == dst.shape, f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ")
    device = check_cuda(kv_cache=kv_cache, src=src, dst=dst)
    if src.numel() == 0 or kv_cache.numel() == 0:
        return
    width, block_words = _block_word(kv_cache)
    _launch(copy_kernel_name(width), device, kv_cache, (src, dst), src.numel(), block_words)


def _gather_scatter(
    kv_cache: torch.Tensor, staging: torch.Tensor, block_ids: torch.Tensor, scatter: bool
) -> None:
    _check_cache(kv_cache)
    _check_ids("block_ids", block_ids)
    check_tensor("staging", staging, 6, (*DTYPES, FP8))
    expected = (
        kv_cache.shape[0],
        2,
        block_ids.shape[0],
        *kv_cache.shape[3:],
    )
    check(
        tuple(staging.shape) == expected,
        f"staging must be {expected} (kv_cache[:, :, block_ids]), got {tuple(staging.shape)}",
    )
    check(
        staging.dtype == kv_cache.dtype,
        f"staging dtype {staging.dtype} must equal kv_cache dtype {kv_cache.dtype}",
    )
    check_contiguous("staging", staging)
    device = check_cuda(kv_cache=kv_cache, staging=staging, block_ids=block_ids)
    if block_ids.numel() == 0 or kv_cache.numel() == 0:
        return
    width, block_words = _block_word(kv_cache, staging)
    name = gather_scatter_kernel_name(width, scatter)
    n = block_ids.numel()
    _launch(name, device, kv_cache, (staging, block_ids), n, n, block_words)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """staging = kv_cache[:, :, block_ids]; staging: [num_layers, 2, n, block_size, Hkv, D]."""
    _gather_scatter(kv_cache, staging, block_ids, scatter=False)


def scatter_blocks(staging: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """kv_cache[:, :, block_ids] = staging; block_ids must be distinct."""
    _gather_scatter(kv_cache, staging, block_ids, scatter=True)
