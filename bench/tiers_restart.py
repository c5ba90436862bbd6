"""`deja bench tiers --part restart`: the first request after a restart, and disk load speed.

For each prefix length (1k and 4k tokens; --quick: 128 and 256) an engine with write-through
serves prefix + suffix and closes (flushing its writes). Then the first request with the same
prefix and a new 8-token suffix (max_tokens 1) is timed after a warm-up request on other tokens:
    recompute   prefix caching off (one engine, `--restart-reps` requests)
    disk-warm   a new engine on the directory (files in the OS page cache)
    warm-cpu    a new engine with --warm-start-blocks covering the prefix, read into the CPU tier
                before the request (`load_warm_start`, timed apart and not in the TTFT)
disk-warm and warm-cpu alternate, each on a fresh engine per repetition; medians are printed.
Each TTFT is split into fetch (disk probes and reads, plan copies into the device cache: the
tier's own work) and the rest (the forward over the suffix, scheduling). NOTE: on a loaded
machine the forward of even 8 tokens varies by seconds; compare fetch times to judge the tiers.

Disk load speed: the prefix's block files read and verified by the disk tier (`DiskFiles.read`:
read, XXH3 check, queued mtime refresh) in bytes/s, against a plain sequential read of the same
files in the same run (page cache warm for both; medians of interleaved passes).
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common

BS = 16


def tier_llm(model_path: str, args: argparse.Namespace, **cfg: Any) -> Any:
    """Our engine on the CPU with blocks of `BS` tokens (`cfg`: its tiers and pools) and KV in
    --kv-cache-dtype (fp8 blocks on every tier with fp8_e4m3)."""
    kv = getattr(args, "kv_cache_dtype", "auto")
    return common.our_llm(model_path, args, block_size=BS, kv_cache_dtype=kv, **cfg)


def _fetch_clock(llm: Any) -> list[float]:
    """Wraps the engine's disk probes and plan application; box[0] sums their seconds."""
    box = [0.0]
    runner = llm.engine.core.runner
    apply = runner.apply_plan

    def timed_apply(plan: Any) -> None:
        t0 = time.perf_counter()
        apply(plan)
        box[0] += time.perf_counter() - t0

    runner.apply_plan = timed_apply
    store = llm.engine.core.offload
    if store is not None and store.disk is not None:
        probe = store.disk.probe

        def timed_probe(h: bytes) -> bool:
            t0 = time.perf_counter()
            found = bool(probe(h))
            box[0] += time.perf_counter() - t0
            return found

        store.disk.probe = timed_probe
    return box


def _ttft(llm: Any, prompt: list[int], clock: list[float] | None = None) -> dict[str, Any]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if clock is not None:
        clock[0] = 0.0
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    assert out.error is None, out.error
    return {
        "ttft_s": time.perf_counter() - t0,
        "fetch_s": clock[0] if clock is not None else 0.0,
        "cached": out.cached_tokens,
    }


def load_speed(files: Any, hashes: list[bytes], passes: int = 5) -> dict[str, float]:
    """Bytes/s of the tier's verified reads vs plain reads of the same files (page cache warm),
    medians of `passes` interleaved passes."""
    paths = [files.path(h) for h in hashes]
    for p in paths:  # warm the page cache for both
        Path(p).read_bytes()
    total = sum(Path(p).stat().st_size for p in paths)
    plain: list[float] = []
    tier: list[float] = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for p in paths:
            with open(p, "rb") as f:
                f.read()
        plain.append(total / (time.perf_counter() - t0))
        files._touched.clear()  # every read queues its mtime refresh, as after a restart
        t0 = time.perf_counter()
        for h in hashes:
            assert files.read(h) is not None
        files.end_step()
        tier.append(total / (time.perf_counter() - t0))
    p_med, t_med = statistics.median(plain), statistics.median(tier)
    return {"tier_bytes_s": t_med, "plain_bytes_s": p_med, "ratio": t_med / p_med}


def _med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _drop(llm: Any) -> None:
    llm.engine.close()
    del llm
    gc.collect()


def run_restart(
    args: argparse.Namespace, model_path: str, ids: list[int], quick: bool
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    reps = getattr(args, "restart_reps", None) or (1 if quick else 3)
    lengths = getattr(args, "restart_prefixes", None) or ((128, 256) if quick else (1024, 4096))
    out: dict[str, Any] = {"reps": reps}
    for plen in lengths:
        prefix = common.random_prompt(rng, ids, plen)

        def request() -> list[int]:
            return prefix + common.random_prompt(rng, ids, 8)  # noqa: B023 (used in this iteration)

        blocks = plen // BS + 2
        disk_dir = tempfile.mkdtemp(prefix="deja-bench-restart-")
        rec: list[dict[str, Any]] = []
        disk: list[dict[str, Any]] = []
        cpu: list[dict[str, Any]] = []
        warm_s: list[float] = []
        speed: dict[str, float] = {}
        try:
            shared = {"num_device_blocks": blocks + 2, "disk_dir": disk_dir}
            seed = tier_llm(model_path, args, num_cpu_blocks=8, **shared)
            _ttft(seed, request())
            _drop(seed)
            e = tier_llm(
                model_path, args, num_device_blocks=blocks + 2, enable_prefix_caching=False
            )
            _ttft(e, common.random_prompt(rng, ids, 16))  # warm up kernels
            rec = [_ttft(e, request()) for _ in range(reps)]
            _drop(e)
            for r in range(reps):
                e = tier_llm(model_path, args, num_cpu_blocks=8, **shared)
                clock = _fetch_clock(e)
                _ttft(e, common.random_prompt(rng, ids, 16))
                disk.append(_ttft(e, request(), clock))
                if r == 0:
                    store = e.engine.core.offload
                    hashes = list(store.disk_index.entries)[-(plen // BS) :]
                    speed = load_speed(store.disk, hashes)
                _drop(e)
                e = tier_llm(
                    model_path, args, num_cpu_blocks=blocks, warm_start_blocks=blocks, **shared
                )
                t0 = time.perf_counter()
                e.engine.core.load_warm_start(timeout_s=300)
                warm_s.append(time.perf_counter() - t0)
                clock = _fetch_clock(e)
                _ttft(e, common.random_prompt(rng, ids, 16))
                cpu.append(_ttft(e, request(), clock))
                _drop(e)
        finally:
            shutil.rmtree(disk_dir, ignore_errors=True)
        t_rec, t_disk, t_cpu = _med(rec, "ttft_s"), _med(disk, "ttft_s"), _med(cpu, "ttft_s")
        row = {
            "recompute_s": t_rec,
            "disk_warm_s": t_disk,
            "warm_cpu_s": t_cpu,
            "disk_speedup": t_rec / t_disk,
            "cpu_speedup": t_rec / t_cpu,
            "disk_fetch_s": _med(disk, "fetch_s"),
            "cpu_fetch_s": _med(cpu, "fetch_s"),
            "warm_start_s": statistics.median(warm_s),
            "disk_hit_tokens": min(r["cached"].disk for r in disk),
            "cpu_hit_tokens": min(r["cached"].cpu for r in cpu),
            "samples_s": {
                "recompute": [r["ttft_s"] for r in rec],
                "disk_warm": [r["ttft_s"] for r in disk],
                "warm_cpu": [r["ttft_s"] for r in cpu],
            },
            "load_speed": speed,
        }
        out[str(plen)] = row
        print(
            f"restart, {plen}-token prefix (median of {reps}): recompute {t_rec * 1e3:.0f} ms | "
            f"disk-warm {t_disk * 1e3:.0f} ms ({row['disk_speedup']:.1f}x, "
            f"{row['disk_hit_tokens']} tokens from disk, fetch {row['disk_fetch_s'] * 1e3:.0f} ms)"
            f" | warm-start CPU {t_cpu * 1e3:.0f} ms ({row['cpu_speedup']:.1f}x, "
            f"{row['cpu_hit_tokens']} tokens from CPU, fetch {row['cpu_fetch_s'] * 1e3:.0f} ms; "
            f"warm start took {row['warm_start_s'] * 1e3:.0f} ms before the request)"
        )
        if speed:
            print(
                f"  disk load speed: tier {speed['tier_bytes_s'] / 1e9:.2f} GB/s vs plain read "
                f"{speed['plain_bytes_s'] / 1e9:.2f} GB/s of the same {plen // BS} files: "
                f"{speed['ratio']:.0%} (target >= 50%)"
            )
    return out
