"""Loader of reshape_and_cache.cu: writes new tokens' K/V into their paged-cache slots."""

from __future__ import annotations

import numpy as np
import torch

from cuda.cupy_launch import (
    DTYPE_NAMES,
    DTYPES,
    FP8,
    WORD_TYPES,
    check,
    check_contiguous,
    check_cuda,
    check_dense_rows,
    check_tensor,
    launch,
    ptr,
    widest_word,
)

CU_FILE = "reshape_and_cache.cu"


def kernel_name(word_bytes: int) -> str:
    return f"deja::reshape_and_cache_kernel<{WORD_TYPES[word_bytes]}>"


def fp8_kernel_name(dtype: torch.dtype) -> str:
    return f"deja::reshape_and_cache_fp8_kernel<{DTYPE_NAMES[dtype]}>"


def instantiations() -> list[str]:
    """Every name expression this loader may compile (the CI compile check builds them all)."""
    return [kernel_name(w) for w in WORD_TYPES] + [fp8_kernel_name(t) for t in DTYPES]


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """kv_cache[0][slot[t]] = k[t] and kv_cache[1][slot[t]] = v[t] for every slot[t] >= 0.

    k, v: [T, Hkv, D], dense in the last two dims (any token stride).
    kv_cache: [2, num_blocks, block_size, Hkv, D] contiguous, same dtype as k/v, or float8_e4m3fn:
    then it gets k / k_scale and v / v_scale, rounded to nearest even and saturated to +-448.
    slot_mapping: [T] int64; negative slots (padding) are skipped, and so are slots past the cache.
    """
    _check_args(k, v, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    device = check_cuda(k=k, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    if kv_cache.dtype == FP8:
        _launch_fp8(k, v, kv_cache, slot_mapping, (k_scale, v_scale), device)
        return

    elem = k.element_size()
    row_bytes = num_kv_heads * head_dim * elem
    half = kv_cache[1]
    width = widest_word(
        row_bytes,
        k.stride(0) * elem,
        v.stride(0) * elem,
        k.data_ptr(),
        v.data_ptr(),
        kv_cache.data_ptr(),
        half.data_ptr(),
    )
    row_words = row_bytes // width
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    threads = min(256, -(-row_words // 32) * 32)
    launch(
        CU_FILE,
        kernel_name(width),
        device,
        grid=(num_tokens, 1, 1),
        block=(threads, 1, 1),
        args=(
            ptr(k),
            ptr(v),
            ptr(kv_cache[0]),
            ptr(half),
            ptr(slot_mapping),
            np.int64(num_slots),
            np.int32(row_words),
            np.int64(k.stride(0) * elem // width),
            np.int64(v.stride(0) * elem // width),
        ),
    )


def _launch_fp8(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[float, float],
    device: torch.device,
) -> None:
    check(min(scales) > 0, lambda: f"fp8 KV scales must be positive, got {scales}")
    num_tokens, num_kv_heads, head_dim = k.shape
    row_elems = num_kv_heads * head_dim
    launch(
        CU_FILE,
        fp8_kernel_name(k.dtype),
        device,
        grid=(num_tokens, 1, 1),
        block=(min(256, -(-row_elems // 32) * 32), 1, 1),
        args=(
            ptr(k),
            ptr(v),
            ptr(kv_cache[0]),
            ptr(kv_cache[1]),
            ptr(slot_mapping),
            np.int64(kv_cache.shape[1] * kv_cache.shape[2]),
            np.int32(row_elems),
            np.int64(k.stride(0)),
            np.int64(v.stride(0)),
            np.float32(1.0 / scales[0]),
            np.float32(1.0 / scales[1]),
        ),
    )


def _check_args(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Shapes, dtypes and strides as `reshape_and_cache` states them."""
    check_tensor("k", k, 3, DTYPES)
    check_tensor("v", v, 3, DTYPES)
    check_tensor("kv_cache", kv_cache, 5, (*DTYPES, FP8))
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    num_tokens, num_kv_heads, head_dim = k.shape
    check(
        v.shape == k.shape, lambda: f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}"
    )
    check(
        kv_cache.shape[0] == 2 and tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim),
        lambda: (
            f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}], "
            f"got {tuple(kv_cache.shape)}"
        ),
    )
    check(
        k.dtype == v.dtype and kv_cache.dtype in (k.dtype, FP8),
        lambda: (
            f"k, v and kv_cache dtypes differ: {k.dtype}, {v.dtype}, {kv_cache.dtype} "
            "(kv_cache may also be float8_e4m3fn)"
        ),
    )
    check(
        slot_mapping.shape[0] == num_tokens,
        lambda: f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens",
    )
    check_dense_rows("k", k)
    check_dense_rows("v", v)
    check_contiguous("kv_cache", kv_cache)
    check_contiguous("slot_mapping", slot_mapping)
