"""Replica-level facts: what model is served and how loaded the engine and its cache are."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_id: str
    """Identity used in block hashes and reported by the API (folder name unless configured)."""
    family: str
    """llama or qwen2."""
    architecture: str
    """The checkpoint's architectures[0], e.g. LlamaForCausalLM."""
    max_model_len: int
    block_size: int
    dtype: str
    """Compute dtype."""
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_device_blocks: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool = False
    """The tokenizer has a chat template (chat messages can be rendered)."""
    kv_cache_dtype: str = "auto"
    """KV storage dtype (CacheConfig.kv_cache_dtype): auto (= dtype) or fp8_e4m3."""
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    """(name, value) of the sampling settings a request that leaves them unset gets (the
    model's generation_config.json under ModelConfig.generation_config auto)."""
    speculative_method: str | None = None
    """Speculative decoding's method (ngram, suffix); None: off."""
    quantization: str = "none"
    """The format the weights are kept in: gguf, awq, gptq, int4, int8; none: in dtype."""
    weight_bytes: int = 0
    """Resident bytes of the weights (rank 0's shard under tensor parallelism)."""

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_device_blocks * self.block_size


@dataclass(slots=True)
class TierStats:
    """One cache tier (device, cpu, disk or remote)."""

    name: str
    num_blocks: int = 0
    """Capacity in blocks (disk: blocks that fit the size budget)."""
    used_blocks: int = 0
    """Blocks holding KV: in use by requests or cached for reuse."""
    cached_blocks: int = 0
    """Blocks with a hash that a later prompt can hit."""
    pinned_blocks: int = 0
    queries: int = 0
    """Prompt tokens looked up in this tier."""
    hits: int = 0
    """Prompt tokens served from this tier."""
    spills: int = 0
    """Blocks copied out of this tier to the next one before reuse."""
    swap_ins: int = 0
    """Blocks brought from this tier back to the device."""
    evictions: int = 0
    """Cached blocks dropped from this tier."""
    bytes_moved: int = 0
    dropped_writes: int = 0
    """Blocks the write policy wanted in this tier but dropped (its writer's queue was full)."""
    write_errors: int = 0
    """Writes into this tier that failed (disk: the first one turns the tier off)."""
    disabled: int = 0
    """1 when the tier turned itself off after a failure (disk: read-only or full directory;
    remote: the store failed and is left alone for a while)."""
    misses: dict[str, int] = field(default_factory=dict)
    """remote: lookups that ended on an unusable value or a failure, by reason
    (engine/kv_io/remote_format.py's MISS_REASONS)."""

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class GrammarCacheStats:
    """Structured outputs: the engine's grammar compile cache (engine/sample/structured/compiler.py)."""

    entries: int = 0
    """Compiled (or compiling) grammars held in the cache."""
    hits: int = 0
    """Submits served by an existing entry."""
    compiles: int = 0
    """Grammars compiled (cache misses)."""
    compile_seconds: float = 0.0
    """Total time spent compiling, on the worker thread."""


@dataclass(frozen=True, slots=True)
class BufferStats:
    """One bounded host-memory buffer or cache of the engine (the CPU tier's tensor, the disk
    tier's read cache and write queue): how full it is now and its caps."""

    name: str
    """cpu_tier, disk_read_cache or disk_write_queue."""
    entries: int
    """Blocks held now (cpu_tier: blocks allocated, all of them, at start)."""
    bytes: int
    """Host bytes those entries hold."""
    max_entries: int
    max_bytes: int


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding since start (vLLM's spec_decode counters)."""

    num_drafts: int = 0
    """Proposals verified (one per sample and step)."""
    num_draft_tokens: int = 0
    """Tokens proposed."""
    num_accepted_tokens: int = 0
    """Proposed tokens accepted."""
    accepted_per_pos: list[int] = field(default_factory=list)
    """Accepted proposals reaching each position (index 0: the first proposed token)."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step gives a sample on average (1 + accepted per proposal)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_usage: float = 0.0
    """Share of device blocks in use by running requests (cached-but-free blocks do not count)."""
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache (all tiers)."""
    prefix_hits: int = 0
    """Prompt tokens served from any tier."""
    free_device_blocks: int = 0
    tiers: list[TierStats] = field(default_factory=list)
    grammar_cache: GrammarCacheStats = field(default_factory=GrammarCacheStats)
    """Structured outputs: compiled grammars held, cache hits, compiles and their time."""
    buffers: list[BufferStats] = field(default_factory=list)
    """The engine's host-memory buffers with their sizes and caps (empty with the tiers off)."""
    queued_prefill_tokens: int = 0
    """Prompt tokens still to compute: waiting requests and running ones still in prefill."""
    num_decoding: int = 0
    """Running sequences past their prefill."""
    active_tokens: int = 0
    """KV tokens computed for the running sequences."""
    prefill_tokens_per_s: float = 0.0
    """Measured (engine/core/step_rates.py); 0.0 until a prefill step ran."""
    decode_seq_s: float = 0.0
    """Measured step seconds per decoding sequence; 0.0 until a decode-only step ran."""
    step_tokens: int = 0
    """The scheduler's token budget per step."""
    utilisation: float = 0.0
    """Share of the last ~120 s spent in steps (engine/core/step_rates.py)."""
    busy_seconds: float = 0.0
    """Wall seconds the engine spent in steps since start (CPU time lost to other processes on
    its core during a step included)."""
    num_steps: int = 0
    """Engine steps since start."""
    spec: SpecStats | None = None
    """Speculative decoding's counters; None when it is off."""

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
