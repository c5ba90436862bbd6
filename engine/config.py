"""One frozen config tree for the engine, validated on construction.

Built once by the entry point (CLI flags / environment) or by `LLM(...)` and passed down.
Nothing inside `engine/` reads the environment.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cupy", "cpu")
PREEMPTION_MODES = ("recompute", "swap")
DISK_WRITE_POLICIES = ("write-through", "selective", "write-back")
REMOTE_WRITE_POLICIES = ("write-through", "selective")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
QUANTIZATIONS = ("auto", "gguf", "awq", "gptq", "int4", "int8", "none")
ACTIVATIONS = ("float", "int8")
GENERATION_CONFIGS = ("auto", "vllm")
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


def check(cond: bool, msg: str) -> None:
    """The config validation step (every config's __post_init__): ValueError(msg) unless cond."""
    if not cond:
        raise ValueError(msg)


def check_one_of(name: str, value: object, choices: tuple[object, ...]) -> None:
    check(value in choices, f"{name} must be one of {choices}, got {value!r}")


def check_port(name: str, port: int | None) -> None:
    """A TCP port (0: a free one); None passes (the endpoint is off)."""
    check(port is None or 0 <= port < 65536, f"{name} must be in [0, 65535], got {port}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str
    """Local Hugging Face checkpoint folder (config.json + safetensors + tokenizer files), or a
    GGUF file (or a folder holding one .gguf file and no config.json)."""
    dtype: str = "float32"
    """Compute and KV-cache dtype: float32, float16, bfloat16, or auto (bfloat16 on a GPU and on
    a CPU with bf16 units, avx512_bf16 or AMX; float32 elsewhere). The library's default is
    float32, exact against transformers' own default; `deja serve` defaults to auto."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None takes the checkpoint's max_position_embeddings."""
    model_id: str | None = None
    """Identity mixed into block hashes and reported by the API; None uses the folder name."""
    quantization: str = "auto"
    """Quantized weights (the CPU; CUDA with the cupy attention backend): auto or gguf keeps a
    GGUF file's Q4_0 / Q4_1 / Q4_K linears 4-bit, its Q8_0 and Q6_K ones 8-bit and (CPU) its
    embedding in its blocks (every other weight is expanded to dtype); auto, awq or gptq keeps an
    AWQ / GPTQ folder's linears 4-bit; int4 / int8 quantize a plain folder's projections at load;
    none expands everything to dtype."""
    activations: str = "float"
    """What a linear kept 4- or 8-bit multiplies (CPU): float, the activations as they are (the
    dequantized weight's product up to summation order, exact); int8, each row quantized to int8
    in groups of 32 and multiplied with integer dot products, as llama.cpp does (faster, not
    exact)."""
    generation_config: str = "auto"
    """auto: the sampling settings of the model's generation_config.json (temperature, top_p,
    top_k, min_p, repetition_penalty) are the defaults of a request that leaves them unset, as
    vLLM's --generation-config auto; vllm: the neutral defaults (temperature 1, ...)."""

    def __post_init__(self) -> None:
        check(bool(self.path), "model path must not be empty")
        check_one_of("dtype", self.dtype, DTYPES)
        check_one_of("quantization", self.quantization, QUANTIZATIONS)
        check_one_of("activations", self.activations, ACTIVATIONS)
        check_one_of("generation_config", self.generation_config, GENERATION_CONFIGS)
        check(
            self.max_model_len is None or self.max_model_len > 0,
            f"max_model_len must be positive, got {self.max_model_len}",
        )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    """Token positions per KV block."""
    num_device_blocks: int | None = None
    """Device KV blocks; None sizes the pool from device_memory_gib."""
    device_memory_gib: float = 1.0
    """KV pool budget in GiB when num_device_blocks is None."""
    enable_prefix_caching: bool = True
    cpu_swap_gib: float = 0.5
    """Host (pinned on CUDA) tier size in GiB; 0 turns the CPU tier off."""
    num_cpu_blocks: int | None = None
    """Exact CPU-tier size in blocks (overrides cpu_swap_gib; used by tests)."""
    disk_dir: str | None = None
    """Directory of the persistent disk tier; None turns it off."""
    disk_gib: float = 10.0
    """Disk tier size budget in GiB (shared by every engine using the same disk_dir)."""
    disk_write_policy: str = "write-through"
    """What reaches the disk tier: write-through (every newly full block, once), selective
    (blocks hit at least disk_write_min_hits times, and pinned prefixes) or write-back (CPU-tier
    blocks about to be reused)."""
    disk_write_min_hits: int = 2
    """Prefix hits that make a block worth writing under the selective policy."""
    disk_write_queue_blocks: int = 256
    """Blocks queued for the disk writer at most; writes beyond are dropped and counted."""
    disk_write_queue_mib: float = 64.0
    """... and MiB of block payloads queued at most (also at most a quarter of the disk tier)."""
    disk_read_cache_mib: float = 32.0
    """Verified disk payloads kept in host memory across steps, in MiB at most (also at most an
    eighth of the disk tier); 0 keeps only the current step's."""
    warm_start_blocks: int = 0
    """Most recently used disk blocks read back into the CPU tier in the background at start."""
    kv_remote: str | None = None
    """URL of the remote tier shared by every replica of the model (redis://HOST:PORT/DB, Redis
    or Valkey); None turns it off. Needs the CPU tier (it sits below it)."""
    kv_remote_write_policy: str = "write-through"
    """What reaches the remote tier: write-through (every newly full block, once) or selective
    (blocks hit at least disk_write_min_hits times, and pinned prefixes)."""
    kv_remote_ttl_s: float = 86400.0
    """Seconds a remote block lives after its last write or hit (the store's own eviction policy,
    e.g. allkeys-lru under a maxmemory, may drop it sooner)."""
    kv_remote_timeout_s: float = 1.0
    """Bound on one remote operation; a store that does not answer in time is left alone for
    kv_remote_retry_s (requests recompute meanwhile)."""
    kv_remote_retry_s: float = 2.0
    """After a failed remote operation, seconds before the tier is tried again."""
    kv_remote_write_queue_blocks: int = 512
    """Blocks queued for the remote writer at most; writes beyond are dropped and counted."""
    kv_remote_buffer_mib: float = 256.0
    """Verified remote payloads held in host memory for requests about to be admitted, MiB."""
    kv_remote_key_prefix: str = "deja:kv:"
    """Prefix of the remote tier's keys (one store may serve several deployments)."""
    preemption_mode: str = "recompute"
    """recompute (drop KV, recompute later) or swap (move KV to the CPU tier and back)."""
    max_pinned_fraction: float = 0.5
    """Largest share of each pool that TTL-pinned prefixes may hold."""
    kv_cache_dtype: str = "auto"
    """Storage dtype of the KV cache on every tier: auto (the model's dtype) or fp8_e4m3
    (float8 e4m3 with one scale per layer for K and one for V; half of bf16's bytes, a quarter
    of float32's)."""
    kv_events_max_blocks: int = 65536
    """KV events (engine/kv/events.py): block hashes buffered per step at most; past that the
    step's events are dropped and replaced by a cleared + snapshot batch. 0 turns events off."""

    def __post_init__(self) -> None:
        check(
            self.block_size in (8, 16, 32, 64),
            f"block_size must be 8, 16, 32 or 64, got {self.block_size}",
        )
        check(
            self.num_device_blocks is None or self.num_device_blocks >= 1,
            f"num_device_blocks must be >= 1, got {self.num_device_blocks}",
        )
        check(self.device_memory_gib > 0, "device_memory_gib must be > 0")
        check(self.cpu_swap_gib >= 0, "cpu_swap_gib must be >= 0")
        check(
            self.num_cpu_blocks is None or self.num_cpu_blocks >= 0, "num_cpu_blocks must be >= 0"
        )
        check(self.disk_gib > 0, "disk_gib must be > 0")
        check_one_of("disk_write_policy", self.disk_write_policy, DISK_WRITE_POLICIES)
        check(self.disk_write_min_hits >= 1, "disk_write_min_hits must be >= 1")
        check(self.disk_write_queue_blocks >= 1, "disk_write_queue_blocks must be >= 1")
        check(self.disk_write_queue_mib > 0, "disk_write_queue_mib must be > 0")
        check(self.disk_read_cache_mib >= 0, "disk_read_cache_mib must be >= 0")
        check(self.warm_start_blocks >= 0, "warm_start_blocks must be >= 0")
        check(
            self.kv_remote is None
            or self.kv_remote.startswith(("redis://", "rediss://", "unix://")),
            f"kv_remote must be a redis://HOST:PORT/DB URL, got {self.kv_remote!r}",
        )
        check_one_of("kv_remote_write_policy", self.kv_remote_write_policy, REMOTE_WRITE_POLICIES)
        check(self.kv_remote_ttl_s > 0, "kv_remote_ttl_s must be > 0")
        check(self.kv_remote_timeout_s > 0, "kv_remote_timeout_s must be > 0")
        check(self.kv_remote_retry_s >= 0, "kv_remote_retry_s must be >= 0")
        check(self.kv_remote_write_queue_blocks >= 1, "kv_remote_write_queue_blocks must be >= 1")
        check(self.kv_remote_buffer_mib > 0, "kv_remote_buffer_mib must be > 0")
        check_one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check(0.0 <= self.max_pinned_fraction <= 1.0, "max_pinned_fraction must be in [0, 1]")
        check(self.kv_events_max_blocks >= 0, "kv_events_max_blocks must be >= 0")
        check_one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most sequences in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decode tokens + prefill chunks)."""
    max_num_partial_prefills: int = 0
    """Most sequences with prefill work in one step; waiting prompts are admitted only below it
    (vLLM's name). 0: no limit, as many as the budget holds. On a CPU, where a step's time
    grows linearly with its tokens, packing several prompts into one step only delays the
    first tokens of all but the last; 1 hands them out one after another."""
    max_n: int = 16
    """Largest n (parallel samples) one request may ask for."""
    max_logprobs: int = 20
    """Largest number of top logprobs one request may ask for."""

    def __post_init__(self) -> None:
        check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        check(self.max_num_partial_prefills >= 0, "max_num_partial_prefills must be >= 0")
        check(self.max_n >= 1, "max_n must be >= 1")
        check(self.max_logprobs >= 0, "max_logprobs must be >= 0")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config, JSON): each decode step of a sample
    verifies up to `num_speculative_tokens` proposed tokens in the same forward pass as the rest
    of the batch (engine/core/spec/)."""

    method: str = "ngram"
    """ngram: prompt lookup over the request's own prompt and output; suffix: the same plus a
    bounded cache of earlier requests' outputs, per tenant (cache salt); draft_model: a smaller
    model with the same tokenizer (`model`) proposes, greedily, with its own KV cache."""
    model: str | None = None
    """draft_model: the draft model's folder (or GGUF file); any model deja serves."""
    num_speculative_tokens: int = 4
    """Most tokens proposed per sample and step."""
    prompt_lookup_min: int = 2
    """Shortest suffix of the sample's tokens that must match earlier text to propose."""
    prompt_lookup_max: int = 8
    """Longest suffix compared (the longest match wins)."""
    disable_by_batch_size: int = 8
    """No proposals while more samples than this are running: a batch that large is no longer
    bound by weight reads, so verifying extra tokens would cost time (0: never propose)."""
    suffix_decoding_max_cached_requests: int = 1000
    """suffix: earlier outputs kept per tenant (the oldest go first); the index costs about
    230 bytes of host memory per cached token (vLLM's default is 10000 requests)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: at most this many proposed tokens per matched token."""

    def __post_init__(self) -> None:
        check_one_of("speculative method", self.method, SPECULATIVE_METHODS)
        check(
            (self.model is not None) == (self.method == "draft_model"),
            '--speculative-config: "model" (a draft model\'s folder) goes with method '
            f'"draft_model" and only with it (method {self.method!r}, model {self.model!r})',
        )
        k = self.num_speculative_tokens
        check(1 <= k <= 32, f"num_speculative_tokens must be in [1, 32], got {k}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        check(lo >= 1, f"prompt_lookup_min must be >= 1, got {lo}")
        check(hi >= lo, f"prompt_lookup_max ({hi}) must be >= prompt_lookup_min ({lo})")
        check(self.disable_by_batch_size >= 0, "disable_by_batch_size must be >= 0")
        check(
            self.suffix_decoding_max_cached_requests >= 0,
            "suffix_decoding_max_cached_requests must be >= 0",
        )
        check(
            self.suffix_decoding_max_spec_factor > 0,
            "suffix_decoding_max_spec_factor must be > 0",
        )

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """Parses --speculative-config (a JSON object, as vLLM spells it); None or "" is off.
        Raises ValueError naming what to fix."""
        if text is None or text == "":
            return None
        if isinstance(text, str):
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON ({e}): {text!r}") from e
        else:
            raw = dict(text)
        if not isinstance(raw, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
        if raw.get("model") is not None:
            raw.setdefault("method", "draft_model")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        for key, value in raw.items():
            kinds: tuple[type, ...] = (int,)
            if key in ("method", "model"):
                kinds = (str,)
            elif key == "suffix_decoding_max_spec_factor":
                kinds = (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ValueError(
                    f"--speculative-config: {key} must be a {kinds[-1].__name__}, got {value!r}"
                )
        return cls(**raw)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    attention_backend: str = "auto"
    """auto (cupy on CUDA when CuPy is present; on the CPU the C++ paged-attention kernel when it
    builds, else torch), torch (the reference), cupy (CUDA kernels) or cpu (the C++ kernel)."""
    seed: int = 0
    """Seed for requests without their own seed."""
    num_threads: int | None = None
    """torch intra-op threads of the process that runs the engine (None: torch's default, one
    per core). Set where the engine is built, in the thread that runs it. Under tensor
    parallelism, per rank (None: the cores divided among the ranks)."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (Megatron): 1 runs it whole in the engine core; N > 1
    starts N - 1 worker processes, one per device (CUDA: NCCL; CPU: gloo)."""
    enforce_eager: bool = False
    """Run every step eagerly: no decode CUDA graphs (vLLM's flag)."""
    async_scheduling: bool = False
    """Schedule and launch each step before the last one's sampled ids are on the host (vLLM's
    flag): the host's work overlaps the GPU's. Steps whose sampling reads the output so far
    (grammars, penalties, min_tokens, n > 1 first tokens, beams) and tensor parallelism still
    wait for their results."""
    max_cuda_graph_batch: int = 256
    """Largest decode batch captured as a CUDA graph (sizes 1, 2, 4, 8, then every 8; capped at
    max_num_seqs). Used only on CUDA with the cupy backend; 0 captures none."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (engine/core/spec/); None: off."""

    def __post_init__(self) -> None:
        check(
            self.num_threads is None or self.num_threads >= 1,
            f"num_threads must be >= 1, got {self.num_threads}",
        )
        check(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}",
        )
        check_one_of("device", self.device, DEVICES)
        check_one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check(
            self.max_cuda_graph_batch >= 0,
            f"max_cuda_graph_batch must be >= 0, got {self.max_cuda_graph_batch}",
        )

    def cuda_graph_batch(self) -> int:
        """Largest decode batch to capture as a CUDA graph; 0 with enforce_eager."""
        if self.enforce_eager:
            return 0
        return min(self.max_cuda_graph_batch, self.scheduler.max_num_seqs)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        """Builds the tree from flat keyword arguments (as `LLM(model, **kwargs)` takes them)."""
        parts: dict[type, dict[str, Any]] = {ModelConfig: {}, CacheConfig: {}, SchedulerConfig: {}}
        top: dict[str, Any] = {}
        top_names = {f.name for f in fields(cls)} - {"model", "cache", "scheduler"}
        for key, value in kwargs.items():
            if key == "speculative_config":  # vLLM's keyword: a dict or its JSON
                top["speculative"] = SpeculativeConfig.from_json(value)
                continue
            for part in parts:
                if key in {f.name for f in fields(part)}:
                    parts[part][key] = value
                    break
            else:
                if key not in top_names:
                    raise ValueError(f"unknown engine option {key!r}")
                top[key] = value
        return cls(
            model=ModelConfig(path=model, **parts[ModelConfig]),
            cache=CacheConfig(**parts[CacheConfig]),
            scheduler=SchedulerConfig(**parts[SchedulerConfig]),
            **top,
        )
