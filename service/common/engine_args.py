"""Engine flags shared by `deja serve`, `deja bench` and anything else that builds an engine.

Every flag reads a DEJA_* variable too (see service/common/flags.py). `engine_config_from_args` turns the
parsed flags into the frozen EngineConfig tree; only it resolves the model name ("demo" is
converted once into the cache folder).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DISK_WRITE_POLICIES,
    DTYPES,
    PREEMPTION_MODES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from service.common.flags import add_bool_flag, add_flag

DEFAULT_MODEL = "demo"
DEFAULT_CACHE_DIR = "~/.cache/deja"
_CACHE = CacheConfig()
_SCHED = SchedulerConfig()


def add_engine_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Adds the engine flags in their own --help group; returns their actions (see to_argv)."""
    g = parser.add_argument_group("engine")
    acts = [
        add_flag(
            g,
            "--model",
            default=DEFAULT_MODEL,
            help='Local Hugging Face checkpoint folder, or "demo" (SmolLM2-135M-Instruct, '
            "converted once into --cache-dir).",
        ),
        add_flag(g, "--cache-dir", default=DEFAULT_CACHE_DIR, help="Where converted models live."),
        add_flag(g, "--model-id", help="Model identity in cache hashes and the API (folder name)."),
        add_flag(g, "--dtype", default="float32", choices=DTYPES, help="Compute and KV dtype."),
        add_flag(g, "--device", default="auto", choices=DEVICES, help="auto: cuda when present."),
        add_flag(g, "--attention-backend", default="auto", choices=ATTENTION_BACKENDS),
        add_flag(
            g, "--threads", type=int, help="torch intra-op threads of the engine (one per core)."
        ),
        add_flag(g, "--max-model-len", type=int, help="Prompt + output limit (checkpoint's)."),
        add_flag(g, "--block-size", type=int, default=_CACHE.block_size, choices=(8, 16, 32, 64)),
        add_flag(
            g,
            "--num-device-blocks",
            type=int,
            help="Device KV blocks (overrides --device-memory-gib).",
        ),
        add_flag(
            g,
            "--device-memory-gib",
            type=float,
            default=_CACHE.device_memory_gib,
            help="KV pool budget on the device.",
        ),
        add_bool_flag(
            g,
            "--prefix-caching",
            default=_CACHE.enable_prefix_caching,
            help="Reuse KV of shared prompt prefixes.",
        ),
        add_flag(
            g,
            "--cpu-swap-gib",
            type=float,
            default=_CACHE.cpu_swap_gib,
            help="CPU cache tier size (0: off).",
        ),
        add_flag(g, "--disk-dir", help="Folder of the persistent disk tier (unset: off)."),
        add_flag(
            g,
            "--disk-gib",
            type=float,
            default=_CACHE.disk_gib,
            help="Disk tier budget (replicas sharing --disk-dir respect it together).",
        ),
        add_flag(
            g,
            "--disk-write-policy",
            default=_CACHE.disk_write_policy,
            choices=DISK_WRITE_POLICIES,
            help="write-through: every new full block goes to disk once; selective: blocks hit "
            "--disk-write-min-hits times and pinned prefixes; write-back: CPU-tier evictions.",
        ),
        add_flag(
            g,
            "--disk-write-min-hits",
            type=int,
            default=_CACHE.disk_write_min_hits,
            help="Prefix hits before the selective policy writes a block.",
        ),
        add_flag(
            g,
            "--disk-write-queue-blocks",
            type=int,
            default=_CACHE.disk_write_queue_blocks,
            help="Disk writes queued at most (more are dropped and counted).",
        ),
        add_flag(
            g,
            "--disk-write-queue-mib",
            type=float,
            default=_CACHE.disk_write_queue_mib,
            help="MiB of block payloads queued for disk writes at most (and a quarter of the "
            "disk tier at most).",
        ),
        add_flag(
            g,
            "--disk-read-cache-mib",
            type=float,
            default=_CACHE.disk_read_cache_mib,
            help="MiB of disk blocks kept in memory after their read (and an eighth of the disk "
            "tier at most).",
        ),
        add_flag(
            g,
            "--warm-start-blocks",
            type=int,
            default=_CACHE.warm_start_blocks,
            help="Most recently used disk blocks read into the CPU tier at start.",
        ),
        add_flag(
            g,
            "--preemption-mode",
            default=_CACHE.preemption_mode,
            choices=PREEMPTION_MODES,
            help="What happens to a preempted request's KV.",
        ),
        add_flag(
            g,
            "--max-pinned-fraction",
            type=float,
            default=_CACHE.max_pinned_fraction,
            help="Largest share of each tier that TTL pins may hold.",
        ),
        add_flag(
            g,
            "--max-num-seqs",
            type=int,
            default=_SCHED.max_num_seqs,
            help="Most sequences per step.",
        ),
        add_flag(
            g,
            "--max-num-batched-tokens",
            type=int,
            default=_SCHED.max_num_batched_tokens,
            help="Token budget of one step.",
        ),
        add_flag(
            g,
            "--max-num-partial-prefills",
            type=int,
            default=_SCHED.max_num_partial_prefills,
            help="Most prompts in prefill in one step (0: as many as the budget holds).",
        ),
        add_flag(g, "--max-n", type=int, default=_SCHED.max_n, help="Largest n per request."),
        add_flag(
            g,
            "--max-logprobs",
            type=int,
            default=_SCHED.max_logprobs,
            help="Largest logprobs per request.",
        ),
        add_flag(g, "--seed", type=int, default=0, help="Seed for requests without their own."),
    ]
    return acts


def resolve_model(args: argparse.Namespace) -> str:
    """The checkpoint folder for --model ("demo" is converted on first use, which takes a while)."""
    from engine.demo import resolve_model_path

    return resolve_model_path(args.model, Path(args.cache_dir).expanduser())


def engine_config_from_args(
    args: argparse.Namespace, *, model_path: str | None = None
) -> EngineConfig:
    """The EngineConfig for parsed engine flags; resolves --model unless model_path is given.

    Raises ValueError (from the config's own checks) on inconsistent values.
    """
    path = model_path if model_path is not None else resolve_model(args)
    return EngineConfig(
        model=ModelConfig(
            path=path,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            model_id=args.model_id,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_device_blocks=args.num_device_blocks,
            device_memory_gib=args.device_memory_gib,
            enable_prefix_caching=args.prefix_caching,
            cpu_swap_gib=args.cpu_swap_gib,
            disk_dir=args.disk_dir,
            disk_gib=args.disk_gib,
            disk_write_policy=args.disk_write_policy,
            disk_write_min_hits=args.disk_write_min_hits,
            disk_write_queue_blocks=args.disk_write_queue_blocks,
            disk_write_queue_mib=args.disk_write_queue_mib,
            disk_read_cache_mib=args.disk_read_cache_mib,
            warm_start_blocks=args.warm_start_blocks,
            preemption_mode=args.preemption_mode,
            max_pinned_fraction=args.max_pinned_fraction,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_partial_prefills=args.max_num_partial_prefills,
            max_n=args.max_n,
            max_logprobs=args.max_logprobs,
        ),
        device=args.device,
        attention_backend=args.attention_backend,
        seed=args.seed,
        num_threads=args.threads,
    )
