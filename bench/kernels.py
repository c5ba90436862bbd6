"""Kernel benchmark (GPU): deja's paged decode attention against memory bandwidth and torch SDPA.

In one run:
1. device-to-device copy bandwidth (torch copy_ of 1 GiB; read + write bytes / time);
2. decode, batch 64, context 4096, 32 query / 8 KV heads, head_dim 128, bf16, block 16: bytes of
   K/V read / kernel time, as a fraction of (1) (target >= 0.70), and against torch's
   scaled_dot_product_attention (flash) over the same K/V laid out contiguously (target <= 1.25x);
3. split-K against the plain kernel at batch 4, context 32768 (target: split-K faster);
4. for information: prefill (16 x 512 new tokens) against SDPA flash, causal.

    deja bench kernels            python -m bench.kernels [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

from bench import common, report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=int, default=50, help="timed launches per measurement")
    parser.add_argument("--block-size", type=int, default=16, choices=(16, 32))
    common.add_json_argument(parser)


def _time_ms(fn: Callable[[], Any], iters: int) -> float:
    """Mean GPU time of fn() in ms (CUDA events around `iters` back-to-back calls, after warmup)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth(iters: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch

    nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), iters)
    return 2 * nbytes / (ms * 1e-3)


def _decode_setup(
    batch: int, ctx: int, hq: int, hkv: int, d: int, bs: int, dtype: Any
) -> dict[str, Any]:
    """A paged cache holding `batch` sequences of `ctx` tokens in shuffled blocks, plus queries."""
    import torch

    blocks_per_seq = math.ceil(ctx / bs)
    num_blocks = batch * blocks_per_seq
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2, num_blocks, bs, hkv, d, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    return {
        "q": torch.randn(batch, hq, d, device="cuda", dtype=dtype, generator=g),
        "cache": cache,
        "tables": perm.view(batch, blocks_per_seq).contiguous(),
        "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
    }


def bench_decode(args: argparse.Namespace, bw: float) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from cuda.paged_attention import paged_decode_attention

    batch, ctx, hq, hkv, d = 64, 4096, 32, 8, 128
    s = _decode_setup(batch, ctx, hq, hkv, d, args.block_size, torch.bfloat16)
    out = torch.empty_like(s["q"])
    scale = 1 / math.sqrt(d)

    def ours() -> None:
        paged_decode_attention(out, s["q"], s["cache"], s["tables"], s["seq_lens"], scale, ctx)

    ms = _time_ms(ours, args.iters)
    kv_bytes = batch * ctx * hkv * d * 2 * s["cache"].element_size()
    achieved = kv_bytes / (ms * 1e-3)

    # The same K/V, contiguous per sequence: [batch, Hkv, ctx, D]
    k = s["cache"][0][s["tables"].long()].reshape(batch, -1, hkv, d)[:, :ctx].transpose(1, 2)
    v = s["cache"][1][s["tables"].long()].reshape(batch, -1, hkv, d)[:, :ctx].transpose(1, 2)
    k, v = k.contiguous(), v.contiguous()
    q4 = s["q"].view(batch, hq, 1, d)
    sdpa_backend = "flash"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa() -> None:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

        sdpa()
    except RuntimeError:
        sdpa_backend = "default (flash refused enable_gqa)"

        def sdpa() -> None:
            F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    sdpa_ms = _time_ms(sdpa, args.iters)
    ref = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True).view_as(out)
    ours()
    max_err = (out.float() - ref.float()).abs().max().item()
    return {
        "kernel_ms": ms,
        "kv_bytes": kv_bytes,
        "achieved_bytes_per_s": achieved,
        "fraction_of_copy_bw": achieved / bw,
        "sdpa_backend": sdpa_backend,
        "sdpa_ms": sdpa_ms,
        "time_vs_sdpa": ms / sdpa_ms,
        "max_abs_err_vs_sdpa": max_err,
    }


def bench_split_k(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from cuda.paged_attention import paged_decode_attention, use_split_k

    batch, ctx, hq, hkv, d = 4, 32768, 32, 8, 128
    s = _decode_setup(batch, ctx, hq, hkv, d, args.block_size, torch.bfloat16)
    out = torch.empty_like(s["q"])
    scale = 1 / math.sqrt(d)
    times: dict[bool, float] = {}
    for split in (False, True):

        def launch(split: bool = split) -> None:
            paged_decode_attention(
                out, s["q"], s["cache"], s["tables"], s["seq_lens"], scale, ctx, split=split
            )

        times[split] = _time_ms(launch, args.iters)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {
        "plain_ms": times[False],
        "split_k_ms": times[True],
        "speedup": times[False] / times[True],
        "heuristic_picks_split": use_split_k(batch * hkv, ctx, sms),
    }


def bench_prefill(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from cuda.prefill_attention import paged_prefill_attention

    seqs, qlen, hq, hkv, d, bs = 16, 512, 32, 8, 128, args.block_size
    s = _decode_setup(seqs, qlen, hq, hkv, d, bs, torch.bfloat16)
    q = torch.randn(seqs * qlen, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.arange(0, seqs * qlen + 1, qlen, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(d)
    ms = _time_ms(
        lambda: paged_prefill_attention(
            out, q, s["cache"], s["tables"], s["seq_lens"], qsl, scale, qlen
        ),
        args.iters,
    )
    k = s["cache"][0][s["tables"].long()].reshape(seqs, qlen, hkv, d).transpose(1, 2).contiguous()
    v = s["cache"][1][s["tables"].long()].reshape(seqs, qlen, hkv, d).transpose(1, 2).contiguous()
    q4 = q.view(seqs, qlen, hq, d).transpose(1, 2).contiguous()
    sdpa_ms = _time_ms(
        lambda: F.scaled_dot_product_attention(
            q4, k, v, is_causal=True, scale=scale, enable_gqa=True
        ),
        args.iters,
    )
    return {"kernel_ms": ms, "sdpa_ms": sdpa_ms, "time_vs_sdpa": ms / sdpa_ms}


def run(args: argparse.Namespace) -> int:
    import torch

    props = report.cuda_device("bench kernels")
    if props is None:
        return 2
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("bench kernels needs CuPy: pip install -e '.[cuda]'")
        return 2
    print(
        f"== deja kernels on {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__} =="
    )
    bw = copy_bandwidth(args.iters)
    decode = bench_decode(args, bw)
    split = bench_split_k(args)
    prefill = bench_prefill(args)
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)")
    report.print_table(
        ["measurement", "value", "target"],
        [
            ["decode b64 ctx4096 32/8 heads d128 bf16: kernel ms", decode["kernel_ms"], ""],
            ["  K/V bytes read / time, GB/s", decode["achieved_bytes_per_s"] / 1e9, ""],
            ["  fraction of copy bandwidth", decode["fraction_of_copy_bw"], ">= 0.70"],
            [f"  SDPA ({decode['sdpa_backend']}) ms, contiguous K/V", decode["sdpa_ms"], ""],
            ["  our time / SDPA time", decode["time_vs_sdpa"], "<= 1.25"],
            ["  max abs diff vs SDPA", decode["max_abs_err_vs_sdpa"], ""],
            ["decode b4 ctx32768: plain ms", split["plain_ms"], ""],
            ["  split-K ms", split["split_k_ms"], ""],
            ["  split-K speedup", split["speedup"], "> 1"],
            ["prefill 16 x 512 causal: kernel ms", prefill["kernel_ms"], ""],
            ["  our time / SDPA (flash, contiguous) time", prefill["time_vs_sdpa"], "info"],
        ],
        digits=3,
    )
    ok = (
        decode["fraction_of_copy_bw"] >= 0.70
        and decode["time_vs_sdpa"] <= 1.25
        and split["speedup"] > 1.0
    )
    print("acceptance 2:", "MET" if ok else "NOT MET")
    report.write_json(
        args.json,
        {
            "device": props.name,
            "copy_bytes_per_s": bw,
            "decode": decode,
            "split_k": split,
            "prefill": prefill,
            "acceptance_met": ok,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.main("deja bench kernels", __doc__, add_arguments, run))
