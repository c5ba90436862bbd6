"""`deja bench tiers --part restart`: the first request after a restart, and disk load speed.

For each prefix length (1k and 4k tokens; --quick: 128 and 256) an engine with write-through
serves prefix + suffix and closes (flushing its writes). Then, each on a fresh engine, the first
request with the same prefix and a new suffix (max_tokens 1) is timed:
    recompute   prefix caching off
    disk-warm   a new engine on the directory (files in the OS page cache)
    warm-cpu    a new engine with --warm-start-blocks covering the prefix (read into the CPU tier
                in the background before the request)
and the disk load speed: the prefix's block files read and verified by the disk tier
(`DiskFiles._read`: read, XXH3 check) in bytes/s, against a plain sequential read of the same
files in the same run.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

BS = 16


def _engine(model_path: str, args: argparse.Namespace, **cfg: Any) -> Any:
    from engine import LLM

    return LLM(
        model_path,
        dtype=args.dtype,
        device="cpu",
        block_size=BS,
        max_num_batched_tokens=args.max_num_batched_tokens,
        **cfg,
    )


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, Any]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    assert out.error is None, out.error
    return time.perf_counter() - t0, out.cached_tokens


def load_speed(files: Any, hashes: list[bytes]) -> dict[str, float]:
    """Bytes/s of the tier's verified reads vs plain reads of the same files (page cache warm)."""
    paths = [files.path(h) for h in hashes]
    for p in paths:  # warm the page cache for both
        Path(p).read_bytes()
    total = sum(Path(p).stat().st_size for p in paths)
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb") as f:
            f.read()
    plain = total / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for h in hashes:
        assert files._read(h) is not None
    tier = total / (time.perf_counter() - t0)
    return {"tier_bytes_s": tier, "plain_bytes_s": plain, "ratio": tier / plain}


def run_restart(
    args: argparse.Namespace, model_path: str, ids: list[int], quick: bool
) -> dict[str, Any]:
    import random

    from bench.common import random_prompt

    rng = random.Random(args.seed)
    out: dict[str, Any] = {}
    for plen in (128, 256) if quick else (1024, 4096):
        prefix = random_prompt(rng, ids, plen)
        first = prefix + random_prompt(rng, ids, 8)
        second = prefix + random_prompt(rng, ids, 8)
        blocks = plen // BS + 2
        disk_dir = tempfile.mkdtemp(prefix="deja-bench-restart-")
        try:
            common = {"num_device_blocks": blocks + 2, "disk_dir": disk_dir}
            a = _engine(model_path, args, num_cpu_blocks=8, **common)
            _ttft(a, first)
            a.engine.close()
            rec = _engine(
                model_path, args, num_device_blocks=blocks + 2, enable_prefix_caching=False
            )
            _ttft(rec, random_prompt(rng, ids, 16))  # warm up kernels
            t_rec, _ = _ttft(rec, second)
            del rec
            b = _engine(model_path, args, num_cpu_blocks=8, **common)
            _ttft(b, random_prompt(rng, ids, 16))
            t_disk, c_disk = _ttft(b, second)
            store = b.engine.offload
            hashes = list(store.disk_index.entries) if store and store.disk_index else []
            speed = load_speed(store.disk, hashes) if store and store.disk else {}
            b.engine.close()
            c = _engine(model_path, args, num_cpu_blocks=blocks, warm_start_blocks=blocks, **common)
            c.engine.load_warm_start(timeout_s=120)
            _ttft(c, random_prompt(rng, ids, 16))
            t_cpu, c_cpu = _ttft(c, second)
            c.engine.close()
        finally:
            shutil.rmtree(disk_dir, ignore_errors=True)
        row = {
            "recompute_s": t_rec,
            "disk_warm_s": t_disk,
            "warm_cpu_s": t_cpu,
            "disk_speedup": t_rec / t_disk,
            "cpu_speedup": t_rec / t_cpu,
            "disk_hit_tokens": c_disk.disk,
            "cpu_hit_tokens": c_cpu.cpu,
            "load_speed": speed,
        }
        out[str(plen)] = row
        print(
            f"restart, {plen}-token prefix: recompute {t_rec * 1e3:.0f} ms | disk-warm "
            f"{t_disk * 1e3:.0f} ms ({row['disk_speedup']:.1f}x, {c_disk.disk} tokens from disk) | "
            f"warm-start CPU {t_cpu * 1e3:.0f} ms ({row['cpu_speedup']:.1f}x, {c_cpu.cpu} tokens "
            "from CPU)"
        )
        if speed:
            print(
                f"  disk load speed: tier {speed['tier_bytes_s'] / 1e9:.2f} GB/s vs plain read "
                f"{speed['plain_bytes_s'] / 1e9:.2f} GB/s of the same {len(hashes)} files: "
                f"{speed['ratio']:.0%} (target >= 50%)"
            )
    return out
