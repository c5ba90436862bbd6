"""Engine flags shared by `deja serve`, `deja bench` and anything else that builds an engine.

Every flag reads a DEJA_* variable too (see service/common/flags.py). `engine_config_from_args` turns the
parsed flags into the frozen EngineConfig tree; only it resolves the model name ("demo" is
converted once into the cache folder).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from engine.config import (
    ACTIVATIONS,
    ATTENTION_BACKENDS,
    DEVICES,
    DISK_WRITE_POLICIES,
    DTYPES,
    GENERATION_CONFIGS,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    REMOTE_WRITE_POLICIES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from service.common.flags import (
    ConfigFlag,
    add_bool_flag,
    add_config_flags,
    add_flag,
    config_values,
)

DEFAULT_MODEL = "demo-gguf"
"""deja serve's model: the demo's GGUF file as it is (its weights kept 4-bit and 8-bit on the CPU)."""
DEFAULT_CACHE_DIR = "~/.cache/deja"
_CACHE = CacheConfig()
_SCHED = SchedulerConfig()


_CACHE_FLAGS = (
    ConfigFlag("block_size", int, choices=(8, 16, 32, 64)),
    ConfigFlag(
        "kv_cache_dtype",
        str,
        "KV storage on every tier; auto: the model dtype; fp8_e4m3: float8 with per-layer "
        "K and V scales (half of bf16's memory).",
        KV_CACHE_DTYPES,
    ),
    ConfigFlag("num_device_blocks", int, "Device KV blocks (overrides --device-memory-gib)."),
    ConfigFlag("device_memory_gib", float, "KV pool budget on the device."),
    ConfigFlag(
        "enable_prefix_caching",
        bool,
        "Reuse KV of shared prompt prefixes.",
        flag="--prefix-caching",
    ),
    ConfigFlag("cpu_swap_gib", float, "CPU cache tier size (0: off)."),
    ConfigFlag("disk_dir", str, "Folder of the persistent disk tier (unset: off)."),
    ConfigFlag(
        "disk_gib", float, "Disk tier budget (replicas sharing --disk-dir respect it together)."
    ),
    ConfigFlag(
        "disk_write_policy",
        str,
        "write-through: every new full block goes to disk once; selective: blocks hit "
        "--disk-write-min-hits times and pinned prefixes; write-back: CPU-tier evictions.",
        DISK_WRITE_POLICIES,
    ),
    ConfigFlag(
        "disk_write_min_hits", int, "Prefix hits before the selective policy writes a block."
    ),
    ConfigFlag(
        "disk_write_queue_blocks", int, "Disk writes queued at most (more are dropped and counted)."
    ),
    ConfigFlag(
        "disk_write_queue_mib",
        float,
        "MiB of block payloads queued for disk writes at most (and a quarter of the "
        "disk tier at most).",
    ),
    ConfigFlag(
        "disk_read_cache_mib",
        float,
        "MiB of disk blocks kept in memory after their read (and an eighth of the disk "
        "tier at most).",
    ),
    ConfigFlag(
        "warm_start_blocks", int, "Most recently used disk blocks read into the CPU tier at start."
    ),
    ConfigFlag(
        "kv_remote",
        str,
        "redis://HOST:PORT/DB of the KV tier shared by every replica of the model (Redis or "
        "Valkey; unset: off). Give the store a maxmemory and an LRU policy.",
    ),
    ConfigFlag(
        "kv_remote_write_policy",
        str,
        "write-through: every new full block goes to the remote tier once; selective: blocks hit "
        "--disk-write-min-hits times and pinned prefixes.",
        REMOTE_WRITE_POLICIES,
    ),
    ConfigFlag(
        "kv_remote_ttl_s", float, "Seconds a remote block lives after its last write or hit."
    ),
    ConfigFlag(
        "kv_remote_timeout_s",
        float,
        "Bound on one remote-tier operation (a slower store is left alone for --kv-remote-retry).",
    ),
    ConfigFlag("kv_remote_retry_s", float, "Seconds before a failed remote tier is tried again."),
    ConfigFlag(
        "kv_remote_write_queue_blocks",
        int,
        "Remote writes queued at most (more are dropped and counted).",
    ),
    ConfigFlag(
        "kv_remote_buffer_mib",
        float,
        "MiB of verified remote blocks held for requests about to be admitted.",
    ),
    ConfigFlag("kv_remote_key_prefix", str, "Prefix of the remote tier's keys."),
    ConfigFlag(
        "preemption_mode", str, "What happens to a preempted request's KV.", PREEMPTION_MODES
    ),
    ConfigFlag("max_pinned_fraction", float, "Largest share of each tier that TTL pins may hold."),
    ConfigFlag(
        "kv_events_max_blocks",
        int,
        "KV-event block hashes buffered per step at most (past it: cleared + snapshot; 0: off).",
    ),
)
"""The CacheConfig fields set by flags, in --help order."""
_SCHED_FLAGS = (
    ConfigFlag("max_num_seqs", int, "Most sequences per step."),
    ConfigFlag("max_num_batched_tokens", int, "Token budget of one step."),
    ConfigFlag(
        "max_num_partial_prefills",
        int,
        "Most prompts in prefill in one step (0: as many as the budget holds).",
    ),
    ConfigFlag("max_n", int, "Largest n per request."),
    ConfigFlag("max_logprobs", int, "Largest logprobs per request."),
)
"""The SchedulerConfig fields set by flags, in --help order."""


def add_engine_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Adds the engine flags in their own --help group; returns their actions (see to_argv)."""
    g = parser.add_argument_group("engine")
    acts = [
        add_flag(
            g,
            "--model",
            default=DEFAULT_MODEL,
            help='Local Hugging Face checkpoint folder, a .gguf file, "demo" '
            '(SmolLM2-135M-Instruct, converted once into --cache-dir) or "demo-gguf" (its '
            "Q4_1 GGUF file as it is).",
        ),
        add_flag(g, "--cache-dir", default=DEFAULT_CACHE_DIR, help="Where converted models live."),
        add_flag(g, "--model-id", help="Model identity in cache hashes and the API (folder name)."),
        add_flag(
            g,
            "--dtype",
            default="auto",
            choices=DTYPES,
            help="Compute and KV dtype; auto: bfloat16 on a GPU or a CPU with bf16 units "
            "(avx512_bf16, AMX), else float32.",
        ),
        add_flag(
            g,
            "--quantization",
            default="auto",
            choices=QUANTIZATIONS,
            help="Quantized weights on the CPU. A GGUF file's Q4_0/Q4_1/Q4_K and Q8_0 linears "
            "and its embedding: gguf or auto keep them 4-bit and 8-bit (other types are expanded). "
            "An AWQ or GPTQ int4 folder's linears: awq / gptq (the folder's method) or auto keep "
            "them 4-bit. A 16- or "
            "32-bit folder: int4 (groups of 32) or int8 (per channel) quantizes its attention and "
            "MLP projections at load. none expands them to --dtype (what a GPU always does).",
        ),
        add_flag(
            g,
            "--activations",
            default="float",
            choices=ACTIVATIONS,
            help="What linears kept 4- or 8-bit multiply on the CPU: float, the activations as "
            "they are (exact against the dequantized weights); int8, each row quantized to int8 "
            "in groups of 32 and integer dot products, as llama.cpp does (about 1.8x faster "
            "products, not exact).",
        ),
        add_flag(
            g,
            "--generation-config",
            default="auto",
            choices=GENERATION_CONFIGS,
            help="auto: the model's generation_config.json sampling settings are the defaults "
            "of requests that leave them unset (as vLLM); vllm: temperature 1, top_p 1, ...",
        ),
        add_flag(g, "--device", default="auto", choices=DEVICES, help="auto: cuda when present."),
        add_flag(g, "--attention-backend", default="auto", choices=ATTENTION_BACKENDS),
        add_flag(
            g, "--threads", type=int, help="torch intra-op threads of the engine (one per core)."
        ),
        add_flag(g, "--max-model-len", type=int, help="Prompt + output limit (checkpoint's)."),
        add_flag(
            g,
            "--tensor-parallel-size",
            type=int,
            default=1,
            help="Ranks the model is split over (one process and device each; CPU: gloo).",
        ),
        add_bool_flag(
            g,
            "--enforce-eager",
            default=False,
            help="Run every step eagerly: no decode CUDA graphs (GPU with the cupy backend).",
        ),
        add_bool_flag(
            g,
            "--async-scheduling",
            default=False,
            help="Schedule each step before the last one's sampled ids reach the host, so the "
            "host's work overlaps the GPU's (steps with grammars, penalties, min_tokens, n > 1 "
            "first tokens or beams still wait; not with tensor parallelism).",
        ),
        add_flag(
            g,
            "--speculative-config",
            help="Speculative decoding, as vLLM spells it (JSON), e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 4}\'; methods: ngram (prompt '
            "lookup), suffix (also earlier outputs of the same tenant). Keys: "
            "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, "
            "disable_by_batch_size, suffix_decoding_max_cached_requests, "
            "suffix_decoding_max_spec_factor.",
        ),
        add_flag(
            g,
            "--max-cuda-graph-batch",
            type=int,
            default=256,
            help="Largest decode batch captured as a CUDA graph (0: none; capped at "
            "--max-num-seqs).",
        ),
        *add_config_flags(g, _CACHE, _CACHE_FLAGS),
        *add_config_flags(g, _SCHED, _SCHED_FLAGS),
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
    spec = SpeculativeConfig.from_json(args.speculative_config)
    if spec is not None and spec.model is not None:  # a draft model: "demo-gguf" or a folder
        from engine.demo import resolve_model_path
        from engine.worker.draft_runner import check_draft_model

        draft = resolve_model_path(spec.model, Path(args.cache_dir).expanduser())
        check_draft_model(path, draft)
        spec = replace(spec, model=draft)
    return EngineConfig(
        model=ModelConfig(
            path=path,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            model_id=args.model_id,
            quantization=args.quantization,
            activations=args.activations,
            generation_config=args.generation_config,
        ),
        cache=CacheConfig(**config_values(args, _CACHE_FLAGS)),
        scheduler=SchedulerConfig(**config_values(args, _SCHED_FLAGS)),
        device=args.device,
        attention_backend=args.attention_backend,
        seed=args.seed,
        num_threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        max_cuda_graph_batch=args.max_cuda_graph_batch,
        speculative=spec,
    )
