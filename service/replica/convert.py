"""Translation between deja.v1 proto messages and engine types (no I/O, no gRPC context)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.message import Message

from engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from engine.outputs import CompletionOutput, RequestOutput
from engine.sample.sampling_params import SamplingParams, apply_defaults
from engine.sample.structured.spec import ResponseFormat
from engine.stats import EngineStats, ModelInfo
from service.api.deja.v1 import inference_pb2 as pb
from service.replica.kv_events import KvBatch

_M = TypeVar("_M", bound=Message)

FINISH_REASONS: dict[str | None, pb.FinishReason] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
FINISH_REASON_NAMES: dict[int, str | None] = {v: k for k, v in FINISH_REASONS.items()}


@dataclass(frozen=True, slots=True)
class EngineInput:
    """What `engine.generate` takes as the prompt."""

    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    operation: str
    """gen_ai.operation.name: text_completion or chat."""


def engine_input(request: pb.GenerateRequest | pb.TokenizeRequest) -> EngineInput:
    """The prompt of a Generate/Tokenize request; ValueError when none is set."""
    which = request.WhichOneof("input")
    if which == "text":
        return EngineInput(request.text, None, "text_completion")
    if which == "token_ids":
        assert isinstance(request, pb.GenerateRequest)
        return EngineInput(list(request.token_ids.ids), None, "text_completion")
    if which == "chat":
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if not messages:
            raise ValueError("chat must hold at least one message")
        for i, m in enumerate(messages):
            if not m["role"]:
                raise ValueError(f"chat message {i} has no role (system, user or assistant)")
        return EngineInput(None, messages, "chat")
    is_generate = isinstance(request, pb.GenerateRequest)
    fields = "text, token_ids or chat" if is_generate else "text or chat"
    raise ValueError(f"the request has no input: set one of {fields}")


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


_EARLY_STOPPING: dict[int, bool | str] = {
    pb.EARLY_STOPPING_FALSE: False,
    pb.EARLY_STOPPING_TRUE: True,
    pb.EARLY_STOPPING_NEVER: "never",
}


def sampling_params(
    request: pb.GenerateRequest, defaults: Mapping[str, float] | None = None
) -> SamplingParams:
    """SamplingParams of a Generate request; range checks are the engine's (it says what to fix).
    `defaults` (ModelInfo.sampling_defaults) fill temperature, top_p, top_k, min_p and
    repetition_penalty where the request leaves them unset (top_k and min_p at 0)."""
    s = request.sampling
    p = SamplingParams(
        top_k=s.top_k,
        min_p=_finite("min_p", s.min_p),
        presence_penalty=_finite("presence_penalty", s.presence_penalty),
        frequency_penalty=_finite("frequency_penalty", s.frequency_penalty),
        min_tokens=s.min_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        pin_ttl_s=_finite("pin_ttl_s", request.pin_ttl_s),
    )
    if s.HasField("n"):
        p.n = s.n
    if s.HasField("temperature"):
        p.temperature = _finite("temperature", s.temperature)
    if s.HasField("top_p"):
        p.top_p = _finite("top_p", s.top_p)
    if s.HasField("repetition_penalty"):
        p.repetition_penalty = _finite("repetition_penalty", s.repetition_penalty)
    if s.HasField("seed"):
        p.seed = s.seed
    if s.HasField("max_tokens"):
        p.max_tokens = s.max_tokens
    if s.HasField("skip_special_tokens"):
        p.skip_special_tokens = s.skip_special_tokens
    if request.HasField("logprobs"):
        p.logprobs = request.logprobs
    p.response_format = response_format(s)
    if s.HasField("best_of"):
        p.best_of = s.best_of
    p.use_beam_search = s.use_beam_search
    if s.HasField("length_penalty"):
        p.length_penalty = _finite("length_penalty", s.length_penalty)
    if s.early_stopping not in _EARLY_STOPPING:
        raise ValueError(f"early_stopping {s.early_stopping} is not a known EarlyStopping value")
    p.early_stopping = _EARLY_STOPPING[s.early_stopping]
    if p.top_k == -1:
        p.top_k = 0
    unset = [f for f in ("temperature", "top_p", "repetition_penalty") if not s.HasField(f)]
    unset += [f for f in ("top_k", "min_p") if getattr(s, f) == 0]
    return apply_defaults(p, unset, defaults or {})


def response_format(s: Any, oneof: str = "response_format") -> ResponseFormat | None:
    """The oneof `oneof` of sampling params `s` as the engine's ResponseFormat (None when unset):
    its fields are named as the kinds (json_schema, json_object, regex, grammar, choice), as in
    deja.v1's `response_format` and vLLM's `constraint`."""
    which = s.WhichOneof(oneof)
    if which is None:
        return None
    if which == "json_object":
        return ResponseFormat.json_object()
    if which == "choice":
        return ResponseFormat.choice(list(s.choice.choices))
    return ResponseFormat(which, getattr(s, which))


def _set_stop_reason(msg: pb.ChoiceDelta | pb.ChoiceEnd, stop_reason: int | str | None) -> None:
    if isinstance(stop_reason, str):
        msg.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        msg.stop_token_id = stop_reason


def choice_delta(c: CompletionOutput, *, return_token_ids: bool) -> pb.ChoiceDelta:
    msg = pb.ChoiceDelta(
        index=c.index, text=c.text, finish_reason=FINISH_REASONS.get(c.finish_reason)
    )
    if return_token_ids:
        msg.token_ids.extend(c.token_ids)
    if c.logprobs:
        for lp in c.logprobs:
            msg.logprobs.append(
                pb.TokenLogprob(
                    token_id=lp.token_id,
                    logprob=lp.logprob,
                    top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
                )
            )
    if c.finish_reason is not None:
        _set_stop_reason(msg, c.stop_reason)
    if c.cumulative_logprob is not None:
        msg.cumulative_logprob = c.cumulative_logprob
    return msg


@dataclass(slots=True)
class StreamTally:
    """What a stream has produced so far: tokens per choice and how each choice ended."""

    completion_tokens: int = 0
    ends: dict[int, tuple[str | None, int | str | None]] = field(default_factory=dict)

    def add(self, out: RequestOutput) -> int:
        """Counts one delta; returns its number of new tokens."""
        new = 0
        for c in out.outputs:
            new += len(c.token_ids)
            if c.finish_reason is not None:
                self.ends[c.index] = (c.finish_reason, c.stop_reason)
        self.completion_tokens += new
        return new

    def finish_reasons(self) -> list[str]:
        return [r or "abort" for _, (r, _) in sorted(self.ends.items())]


def final_message(out: RequestOutput, tally: StreamTally, *, replica_id: str) -> pb.Final:
    """The `final` part of the last message, from the engine's last delta."""
    final = pb.Final(replica_id=replica_id)
    for index, (reason, stop_reason) in sorted(tally.ends.items()):
        end = pb.ChoiceEnd(index=index, finish_reason=FINISH_REASONS.get(reason))
        _set_stop_reason(end, stop_reason)
        final.choices.append(end)
    cached = out.cached_tokens
    final.usage.CopyFrom(
        pb.Usage(
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=tally.completion_tokens,
            cached_prompt_tokens=out.num_cached_tokens,
            cached_by_tier=pb.CachedByTier(
                device=cached.device, cpu=cached.cpu, disk=cached.disk, remote=cached.remote
            ),
        )
    )
    m = out.metrics
    if m is not None and m.num_spec_steps:
        drafted, accepted = m.num_draft_tokens, m.num_accepted_tokens
        steps = max(1, tally.completion_tokens - accepted)
        final.usage.speculative.CopyFrom(
            pb.SpeculativeUsage(
                draft_tokens=drafted,
                accepted_tokens=accepted,
                acceptance_rate=accepted / drafted if drafted else 0.0,
                tokens_per_step=tally.completion_tokens / steps,
            )
        )
    if m is not None:
        final.timings.CopyFrom(
            pb.Timings(queue_s=m.queue_time or 0.0, ttft_s=m.ttft or 0.0, total_s=m.e2e or 0.0)
        )
    if out.pinned is not None:
        final.pinned = out.pinned
    if out.error:
        final.error = out.error
    return final


def _from_fields(cls: type[_M], src: object, **given: Any) -> _M:
    """A `cls` message: the fields in `given`, each other one from `src`'s attribute so named."""
    names = [f.name for f in cls.DESCRIPTOR.fields if f.name not in given]
    return cls(**{name: getattr(src, name) for name in names}, **given)


def model_info_message(info: ModelInfo, replica_id: str) -> pb.ModelInfo:
    return _from_fields(pb.ModelInfo, info, replica_id=replica_id)


def load_message(stats: EngineStats, replica_id: str, **given: Any) -> pb.Load:
    """The Load message of an engine snapshot; `given` holds the server's own fields (streams,
    draining)."""
    return _from_fields(
        pb.Load,
        stats,
        replica_id=replica_id,
        running=stats.num_running,
        waiting=stats.num_waiting,
        decoding=stats.num_decoding,
        **given,
    )


def cache_stats_message(stats: EngineStats, info: ModelInfo, replica_id: str) -> pb.CacheStats:
    return _from_fields(
        pb.CacheStats,
        stats,
        replica_id=replica_id,
        total_device_blocks=info.num_device_blocks,
        tiers=[_from_fields(pb.TierStats, t) for t in stats.tiers],
        buffers=[_from_fields(pb.BufferStats, b) for b in stats.buffers],
    )


KV_MESSAGE_BLOCKS = 16384
"""Block hashes per KvEventBatch message at most (~0.6 MB), well under gRPC's 4 MiB default."""


def kv_batch_messages(
    batch: KvBatch, *, with_tokens: bool, max_blocks: int = KV_MESSAGE_BLOCKS
) -> list[pb.KvEventBatch]:
    """One batch as one message, or as several with its sequence number when it holds more than
    `max_blocks` hashes (a snapshot). Without `with_tokens`, stores carry no token ids."""
    out: list[pb.KvEventBatch] = []
    msg, n = None, max_blocks
    for ev in _split_events(batch.events, max_blocks):
        size = 0 if isinstance(ev, AllBlocksCleared) else len(ev.block_hashes)
        if msg is None or n + size > max_blocks:
            msg = pb.KvEventBatch(
                sequence_number=batch.sequence_number,
                timestamp=batch.timestamp,
                dropped=batch.dropped,
            )
            out.append(msg)
            n = 0
        msg.events.append(_kv_event_message(ev, with_tokens))
        n += size
    if not out:
        out.append(
            pb.KvEventBatch(
                sequence_number=batch.sequence_number,
                timestamp=batch.timestamp,
                dropped=batch.dropped,
            )
        )
    return out


def _split_events(events: list[KVEvent], max_blocks: int) -> list[KVEvent]:
    """Events with more than `max_blocks` hashes cut into chained pieces."""
    out: list[KVEvent] = []
    for ev in events:
        if isinstance(ev, AllBlocksCleared) or len(ev.block_hashes) <= max_blocks:
            out.append(ev)
            continue
        hs = ev.block_hashes
        for i in range(0, len(hs), max_blocks):
            part = hs[i : i + max_blocks]
            if isinstance(ev, BlockRemoved):
                out.append(BlockRemoved(part, ev.medium))
                continue
            bs = ev.block_size
            parent = hs[i - 1] if i else ev.parent_block_hash
            tokens = ev.token_ids[i * bs : (i + len(part)) * bs]
            out.append(BlockStored(part, parent, tokens, bs, ev.medium))
    return out


def _kv_event_message(ev: KVEvent, with_tokens: bool) -> pb.KvEvent:
    if isinstance(ev, BlockStored):
        stored = pb.BlockStored(
            block_hashes=ev.block_hashes, block_size=ev.block_size, medium=ev.medium
        )
        if ev.parent_block_hash is not None:
            stored.parent_block_hash = ev.parent_block_hash
        if with_tokens:
            stored.token_ids.extend(ev.token_ids)
        return pb.KvEvent(block_stored=stored)
    if isinstance(ev, BlockRemoved):
        return pb.KvEvent(
            block_removed=pb.BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium)
        )
    return pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared())
