from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EarlyStopping(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EARLY_STOPPING_FALSE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_TRUE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_NEVER: _ClassVar[EarlyStopping]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
EARLY_STOPPING_FALSE: EarlyStopping
EARLY_STOPPING_TRUE: EarlyStopping
EARLY_STOPPING_NEVER: EarlyStopping
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "session_id", "cache_salt", "pin_ttl_s", "return_token_ids", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_S_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    session_id: str
    cache_salt: str
    pin_ttl_s: float
    return_token_ids: bool
    logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., cache_salt: _Optional[str] = ..., pin_ttl_s: _Optional[float] = ..., return_token_ids: _Optional[bool] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "json_schema", "json_object", "regex", "grammar", "choice", "best_of", "use_beam_search", "length_penalty", "early_stopping")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    USE_BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    skip_special_tokens: bool
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: Choices
    best_of: int
    use_beam_search: bool
    length_penalty: float
    early_stopping: EarlyStopping
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., best_of: _Optional[int] = ..., use_beam_search: _Optional[bool] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[_Union[EarlyStopping, str]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "choices", "prompt_token_ids", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choices: _containers.RepeatedCompositeFieldContainer[ChoiceDelta]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    final: Final
    def __init__(self, request_id: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[ChoiceDelta, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class ChoiceDelta(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason", "stop_token_id", "stop_string", "cumulative_logprob")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    stop_token_id: int
    stop_string: str
    cumulative_logprob: float
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., cumulative_logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("choices", "usage", "timings", "replica_id", "route", "pinned", "error")
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedCompositeFieldContainer[ChoiceEnd]
    usage: Usage
    timings: Timings
    replica_id: str
    route: RouteInfo
    pinned: bool
    error: str
    def __init__(self, choices: _Optional[_Iterable[_Union[ChoiceEnd, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., replica_id: _Optional[str] = ..., route: _Optional[_Union[RouteInfo, _Mapping]] = ..., pinned: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class ChoiceEnd(_message.Message):
    __slots__ = ("index", "finish_reason", "stop_token_id", "stop_string")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    index: int
    finish_reason: FinishReason
    stop_token_id: int
    stop_string: str
    def __init__(self, index: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "cached_by_tier", "speculative")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    cached_by_tier: CachedByTier
    speculative: SpeculativeUsage
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., cached_by_tier: _Optional[_Union[CachedByTier, _Mapping]] = ..., speculative: _Optional[_Union[SpeculativeUsage, _Mapping]] = ...) -> None: ...

class SpeculativeUsage(_message.Message):
    __slots__ = ("draft_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_step")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    tokens_per_step: float
    def __init__(self, draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., tokens_per_step: _Optional[float] = ...) -> None: ...

class CachedByTier(_message.Message):
    __slots__ = ("device", "cpu", "disk", "remote")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    device: int
    cpu: int
    disk: int
    remote: int
    def __init__(self, device: _Optional[int] = ..., cpu: _Optional[int] = ..., disk: _Optional[int] = ..., remote: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "ttft_s", "total_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    ttft_s: float
    total_s: float
    def __init__(self, queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class RouteInfo(_message.Message):
    __slots__ = ("replica_id", "reason")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    reason: str
    def __init__(self, replica_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "family", "architecture", "max_model_len", "block_size", "dtype", "vocab_size", "num_device_blocks", "kv_capacity_tokens", "eos_token_ids", "replica_id", "has_chat_template", "quantization", "weight_bytes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    family: str
    architecture: str
    max_model_len: int
    block_size: int
    dtype: str
    vocab_size: int
    num_device_blocks: int
    kv_capacity_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    replica_id: str
    has_chat_template: bool
    quantization: str
    weight_bytes: int
    def __init__(self, model_id: _Optional[str] = ..., family: _Optional[str] = ..., architecture: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., replica_id: _Optional[str] = ..., has_chat_template: _Optional[bool] = ..., quantization: _Optional[str] = ..., weight_bytes: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("replica_id", "running", "waiting", "kv_usage", "prefix_hit_rate", "active_streams", "queued_streams", "draining", "queued_prefill_tokens", "decoding", "active_tokens", "prefill_tokens_per_s", "decode_seq_s", "step_tokens", "utilisation")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODING_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEQ_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    running: int
    waiting: int
    kv_usage: float
    prefix_hit_rate: float
    active_streams: int
    queued_streams: int
    draining: bool
    queued_prefill_tokens: int
    decoding: int
    active_tokens: int
    prefill_tokens_per_s: float
    decode_seq_s: float
    step_tokens: int
    utilisation: float
    def __init__(self, replica_id: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., prefix_hit_rate: _Optional[float] = ..., active_streams: _Optional[int] = ..., queued_streams: _Optional[int] = ..., draining: _Optional[bool] = ..., queued_prefill_tokens: _Optional[int] = ..., decoding: _Optional[int] = ..., active_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_seq_s: _Optional[float] = ..., step_tokens: _Optional[int] = ..., utilisation: _Optional[float] = ...) -> None: ...

class GetCacheStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "num_blocks", "used_blocks", "cached_blocks", "pinned_blocks", "queries", "hits", "spills", "swap_ins", "evictions", "bytes_moved", "dropped_writes", "write_errors", "disabled", "misses")
    class MissesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    SPILLS_FIELD_NUMBER: _ClassVar[int]
    SWAP_INS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_blocks: int
    used_blocks: int
    cached_blocks: int
    pinned_blocks: int
    queries: int
    hits: int
    spills: int
    swap_ins: int
    evictions: int
    bytes_moved: int
    dropped_writes: int
    write_errors: int
    disabled: int
    misses: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., num_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., queries: _Optional[int] = ..., hits: _Optional[int] = ..., spills: _Optional[int] = ..., swap_ins: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., dropped_writes: _Optional[int] = ..., write_errors: _Optional[int] = ..., disabled: _Optional[int] = ..., misses: _Optional[_Mapping[str, int]] = ...) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("replica_id", "tiers", "free_device_blocks", "total_device_blocks", "prefix_queries", "prefix_hits", "buffers")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    FREE_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    free_device_blocks: int
    total_device_blocks: int
    prefix_queries: int
    prefix_hits: int
    buffers: _containers.RepeatedCompositeFieldContainer[BufferStats]
    def __init__(self, replica_id: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., free_device_blocks: _Optional[int] = ..., total_device_blocks: _Optional[int] = ..., prefix_queries: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., buffers: _Optional[_Iterable[_Union[BufferStats, _Mapping]]] = ...) -> None: ...

class BufferStats(_message.Message):
    __slots__ = ("name", "entries", "bytes", "max_entries", "max_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    entries: int
    bytes: int
    max_entries: int
    max_bytes: int
    def __init__(self, name: _Optional[str] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., max_entries: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted: _Optional[_Iterable[str]] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("start_sequence_number",)
    START_SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    start_sequence_number: int
    def __init__(self, start_sequence_number: _Optional[int] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("sequence_number", "timestamp", "events", "dropped")
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    sequence_number: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    dropped: bool
    def __init__(self, sequence_number: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., dropped: _Optional[bool] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
