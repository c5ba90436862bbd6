"""Whole-block copies between two KV caches of one layout in different memories (CPU tier <-> GPU).

Both caches are [num_layers, 2, num_blocks, block_size, Hkv, D] contiguous, so block b of plane p
(p = layer * 2 + kv) is one run of `block_bytes` at (p * num_blocks + b) * block_bytes, and a run of
consecutive blocks in both caches is a matrix of num_planes rows: one cudaMemcpy2DAsync moves it
straight between pinned host memory and the device, with no gather, staging tensor or scatter.

Pairs are sorted by source and merged into runs where both ids are consecutive, so a swap-in of
blocks that were spilled together costs one copy per run instead of one per block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cuda.cupy_launch import check, check_contiguous, import_cupy

MEMCPY_DEFAULT = 4
"""cudaMemcpyDefault: the direction follows from the pointers (unified addressing)."""


def runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, count) runs covering `pairs` (src, dst), merged where both ids are consecutive."""
    out: list[tuple[int, int, int]] = []
    for s, d in sorted(pairs):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def copy_blocks_between(
    dst: torch.Tensor,
    src: torch.Tensor,
    pairs: Sequence[tuple[int, int]],
    stream: torch.cuda.Stream,
) -> None:
    """dst[:, :, d] = src[:, :, s] for every (s, d) in pairs, enqueued on `stream` (asynchronous).

    One side is a CUDA tensor, the other a CUDA tensor or pinned host memory (pageable memory
    would make the copy synchronous). The caller keeps both alive until the stream is past it.
    """
    check(dst.dim() == 6 and src.dim() == 6, "caches must be [L, 2, N, block_size, Hkv, D]")
    check(
        dst.shape[:2] == src.shape[:2] and dst.shape[3:] == src.shape[3:],
        f"cache layouts differ: {tuple(dst.shape)} vs {tuple(src.shape)}",
    )
    check(dst.dtype == src.dtype, f"cache dtypes differ: {dst.dtype} vs {src.dtype}")
    check_contiguous("dst", dst)
    check_contiguous("src", src)
    for t in (dst, src):
        check(t.is_cuda or t.is_pinned(), "host-side caches must be in pinned memory")
    if not pairs:
        return
    n_dst, n_src = dst.shape[2], src.shape[2]
    check(
        all(0 <= s < n_src and 0 <= d < n_dst for s, d in pairs),
        f"block ids out of range (src {n_src} blocks, dst {n_dst} blocks)",
    )
    cupy = import_cupy()
    runtime = cupy.cuda.runtime
    device = dst.device if dst.is_cuda else src.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    block_bytes = dst[0, 0, 0].numel() * dst.element_size()
    planes = dst.shape[0] * 2
    dst_ptr, src_ptr = dst.data_ptr(), src.data_ptr()
    with cupy.cuda.Device(index):
        for s, d, count in runs(pairs):
            runtime.memcpy2DAsync(
                dst_ptr + d * block_bytes,
                n_dst * block_bytes,
                src_ptr + s * block_bytes,
                n_src * block_bytes,
                count * block_bytes,
                planes,
                MEMCPY_DEFAULT,
                stream.cuda_stream,
            )
