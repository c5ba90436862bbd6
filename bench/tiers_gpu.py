"""CPU tier on CUDA (GPU): swap-in and spill through KVOffload against torch's pinned copy bandwidth.

In one run, on a Llama-3.2-1B-shaped cache (16 layers, block 16, 8 KV heads, head_dim 64, bf16:
512 KiB per block over all layers):
1. pinned H2D and D2H bandwidth: torch `copy_(non_blocking=True)` of one contiguous pinned tensor
   the size of the swap (events around the copies);
2. swap-in of N blocks from the pinned CPU tier into the device cache through `KVOffload.apply`
   (host time from the call to the end of the copies: the plan's whole cost), with the pairs
   scattered at random and in runs of consecutive ids (blocks spilled together), for the direct
   path (cuda/tier_copy.py) and the staged path (gather, pin, copy, scatter);
3. spills the same way (device -> CPU tier), for information.
Target: swap-in >= 50% of the pinned H2D bandwidth.

    python -m bench.tiers_gpu [--blocks 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from bench import common, report

LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 16, 16, 8, 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=512, help="blocks per swap")
    parser.add_argument("--iters", type=int, default=10)
    common.add_json_argument(parser)


def _pairs(n: int, num_src: int, num_dst: int, scattered: bool, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    if scattered:
        return list(zip(rng.sample(range(num_src), n), rng.sample(range(num_dst), n), strict=True))
    s0, d0 = rng.randrange(num_src - n + 1), rng.randrange(num_dst - n + 1)
    return [(s0 + i, d0 + i) for i in range(n)]


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.kv.plan import KVPlan
    from engine.kv_io.offload import KVOffload

    props = report.cuda_device("bench tiers-gpu")
    if props is None:
        return 2
    n = args.blocks
    num_blocks = 2 * n
    shape = (LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    dev = torch.randn(shape, device="cuda").to(torch.bfloat16)
    cpu = torch.randn(shape).to(torch.bfloat16).pin_memory()
    nbytes = n * dev[:, :, 0].numel() * dev.element_size()

    def events_ms(fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / args.iters

    host_src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = nbytes / (events_ms(lambda: dev_buf.copy_(host_src, non_blocking=True)) * 1e-3)
    d2h = nbytes / (events_ms(lambda: host_src.copy_(dev_buf, non_blocking=True)) * 1e-3)

    store = KVOffload(cpu)
    rows: list[list[Any]] = []
    results: dict[str, Any] = {"h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h, "bytes": nbytes}
    for direct in (True, False):
        store.direct_copies = direct
        for scattered in (True, False):
            for kind in ("swap_in", "spill"):
                times = []
                for it in range(args.iters + 1):
                    pairs = _pairs(n, num_blocks, num_blocks, scattered, it)
                    plan = KVPlan(swap_in=pairs) if kind == "swap_in" else KVPlan(spill=pairs)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    store.apply(plan, dev)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                    if it == 0 and kind == "swap_in":  # correctness of one swap
                        s, d = pairs[len(pairs) // 2]
                        assert torch.equal(dev[:, :, d].cpu(), cpu[:, :, s]), "swap-in mismatch"
                    if it == 0 and kind == "spill":
                        d, s = pairs[len(pairs) // 2]
                        assert torch.equal(cpu[:, :, s], dev[:, :, d].cpu()), "spill mismatch"
                t = sorted(times[1:])[len(times[1:]) // 2]
                bw = nbytes / t
                ref = h2d if kind == "swap_in" else d2h
                name = f"{kind} {'direct' if direct else 'staged'} {'scattered' if scattered else 'runs'}"
                rows.append([name, t * 1e3, bw / 1e9, bw / ref])
                results[name] = {"ms": t * 1e3, "bytes_per_s": bw, "fraction": bw / ref}
    print(
        f"== CPU tier on {props.name}: {n} blocks of {nbytes // n} bytes = {nbytes / 2**20:.0f} MiB =="
    )
    print(f"torch pinned H2D: {h2d / 1e9:.1f} GB/s, D2H: {d2h / 1e9:.1f} GB/s")
    report.print_table(
        ["plan (KVOffload.apply, host time)", "ms", "GB/s", "of pinned copy"], rows, digits=3
    )
    ok = results["swap_in direct scattered"]["fraction"] >= 0.5
    print(
        "acceptance 4 (swap-in >= 50% of pinned H2D, scattered blocks):", "MET" if ok else "NOT MET"
    )
    results["device"] = props.name
    results["acceptance_met"] = ok
    report.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(common.main("deja bench tiers-gpu", __doc__, add_arguments, run))
