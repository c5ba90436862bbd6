"""Translation between `vllm.grpc.engine` messages (the SMG gateway's engine protocol, stubs from
the pinned `smg-grpc-proto`) and deja's engine types and deja.v1 messages (no I/O, no context).

The gateway tokenizes and detokenizes itself: a Generate carries token ids and gets token ids
back, as deltas while streaming and as one `GenerateComplete` per choice at the end.
"""

from __future__ import annotations

import hashlib
import io
import math
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from engine.kv.events import AllBlocksCleared, BlockStored, KVEvent
from engine.sample.sampling_params import SamplingParams, apply_defaults
from engine.sample.structured.spec import RESPONSE_FORMAT_KINDS, ResponseFormat
from engine.stats import EngineStats
from service.api.deja.v1 import inference_pb2 as pb
from service.replica.convert import FINISH_REASON_NAMES, response_format
from service.replica.kv_events import KvBatch

TOKENIZER_CHUNK_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_TIERS = {
    "device": common_pb2.KV_CACHE_TIER_DEVICE,
    "cpu": common_pb2.KV_CACHE_TIER_HOST,
    "disk": common_pb2.KV_CACHE_TIER_DISK,
    "remote": common_pb2.KV_CACHE_TIER_EXTERNAL,
}
_CACHE_LEVELS = {"device": 0, "cpu": 1, "disk": 2, "remote": 3}


def deja_request(request: vpb.GenerateRequest) -> pb.GenerateRequest:
    """The deja.v1 request that carries the prompt and id (sampling is mapped separately, by
    `sampling_params`); ValueError names what deja does not serve."""
    for name in ("mm_inputs", "media_refs", "kv_transfer_params"):
        if request.HasField(name):
            raise ValueError(f"{name} is not supported by deja (text-only, no PD transfer)")
    if request.extra_mm_inputs:
        raise ValueError("extra_mm_inputs is not supported by deja (text-only models)")
    if request.HasField("kv_transfer_params_json"):
        raise ValueError("kv_transfer_params_json is not supported by deja (no PD transfer)")
    out = pb.GenerateRequest(request_id=request.request_id, return_token_ids=True)
    which = request.WhichOneof("input")
    if which == "tokenized":
        if not request.tokenized.input_ids:
            raise ValueError("tokenized.input_ids is empty: send at least one prompt token")
        out.token_ids.ids.extend(request.tokenized.input_ids)
    elif which == "text":
        out.text = request.text
    else:
        raise ValueError("the request has no input: set tokenized.input_ids or text")
    return out


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def sampling_params(
    s: vpb.SamplingParams, defaults: Mapping[str, float] | None = None
) -> SamplingParams:
    """The engine's SamplingParams, with vLLM's servicer's reading of proto3 zeros (top_p,
    repetition_penalty and n at 0 mean unset) and no max_tokens meaning up to max_model_len.
    Range checks are the engine's (its message says what to fix). `defaults`
    (ModelInfo.sampling_defaults) fill the unset temperature, top_p, top_k, min_p and
    repetition_penalty, as vLLM's generation-config defaults do.

    NOTE: SMG's SamplingParams has no beam-search or best_of fields, so a gateway request never
    asks for them (deja.v1's SamplingParams carries use_beam_search, best_of, length_penalty
    and early_stopping)."""
    if s.HasField("prompt_logprobs"):
        raise ValueError("prompt_logprobs is not supported by deja; leave it unset")
    if s.logit_bias:
        raise ValueError("logit_bias is not supported by deja; leave it empty")
    if s.HasField("truncate_prompt_tokens"):
        raise ValueError("truncate_prompt_tokens is not supported by deja; send a shorter prompt")
    if s.include_stop_str_in_output:
        raise ValueError("include_stop_str_in_output is not supported by deja")
    p = SamplingParams(
        n=s.n or 1,
        temperature=_finite("temperature", s.temperature) if s.HasField("temperature") else 1.0,
        top_k=s.top_k,
        top_p=_finite("top_p", s.top_p) or 1.0,
        min_p=_finite("min_p", s.min_p),
        repetition_penalty=_finite("repetition_penalty", s.repetition_penalty) or 1.0,
        presence_penalty=_finite("presence_penalty", s.presence_penalty),
        frequency_penalty=_finite("frequency_penalty", s.frequency_penalty),
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        min_tokens=s.min_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens,
        seed=s.seed if s.HasField("seed") else None,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
    )
    p.response_format = _constraint(s)
    unset = ["temperature"] if not s.HasField("temperature") else []
    unset += [f for f in ("top_p", "top_k", "min_p", "repetition_penalty") if getattr(s, f) == 0]
    return apply_defaults(p, unset, defaults or {})


def _constraint(s: vpb.SamplingParams) -> ResponseFormat | None:
    which = s.WhichOneof("constraint")
    if which is not None and which not in RESPONSE_FORMAT_KINDS:
        raise ValueError(f"constraint {which} is not supported by deja (json_schema, json_object, "
                         "regex, grammar or choice)")  # fmt: skip
    return response_format(s, "constraint")


@dataclass(slots=True)
class _Choice:
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    """Every id so far (kept only without streaming, for the Complete)."""
    logprobs: vpb.OutputLogProbs = field(default_factory=vpb.OutputLogProbs)


@dataclass(slots=True)
class ResponseMapper:
    """Turns one deja.v1 Generate stream into VllmEngine responses: a chunk per choice delta
    while streaming (new ids only), then one Complete per choice, ordered by index, when the
    request has finished (the final message carries usage and cached tokens). Without `stream`
    the Completes carry every id and logprob of their choice."""

    stream: bool
    prompt_tokens: int = 0
    choices: dict[int, _Choice] = field(default_factory=dict)

    def map(self, resp: pb.GenerateResponse) -> Iterator[vpb.GenerateResponse]:
        if resp.prompt_token_ids:
            self.prompt_tokens = len(resp.prompt_token_ids)
        for d in resp.choices:
            c = self.choices.setdefault(d.index, _Choice())
            c.num_tokens += len(d.token_ids)
            lp = _logprobs(d)
            if self.stream:
                if d.token_ids or lp.token_ids:
                    yield vpb.GenerateResponse(chunk=vpb.GenerateStreamChunk(
                        token_ids=d.token_ids, prompt_tokens=self.prompt_tokens,
                        completion_tokens=len(d.token_ids), index=d.index,
                        output_logprobs=lp if lp.token_ids else None,
                    ))  # fmt: skip
            else:
                c.token_ids.extend(d.token_ids)
                c.logprobs.MergeFrom(lp)
        if resp.HasField("final"):
            yield from self._completes(resp.final)

    def _completes(self, final: pb.Final) -> Iterator[vpb.GenerateResponse]:
        usage = final.usage
        for end in final.choices:
            c = self.choices.get(end.index, _Choice())
            msg = vpb.GenerateComplete(
                finish_reason=FINISH_REASON_NAMES.get(end.finish_reason) or "abort",
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=c.num_tokens,
                cached_tokens=usage.cached_prompt_tokens,
                index=end.index,
            )
            if not self.stream:
                msg.output_ids.extend(c.token_ids)
                if c.logprobs.token_ids:
                    msg.output_logprobs.CopyFrom(c.logprobs)
            which = end.WhichOneof("stop_reason")
            if which == "stop_token_id":
                msg.matched_token_id = end.stop_token_id
            elif which == "stop_string":
                msg.matched_stop_str = end.stop_string
            yield vpb.GenerateResponse(complete=msg)


def _logprobs(d: pb.ChoiceDelta) -> vpb.OutputLogProbs:
    out = vpb.OutputLogProbs()
    for lp in d.logprobs:
        out.token_ids.append(lp.token_id)
        out.token_logprobs.append(lp.logprob)
        if lp.top:
            out.top_logprobs.append(
                vpb.TopLogProbs(
                    token_ids=[t.token_id for t in lp.top], values=[t.logprob for t in lp.top]
                )
            )
    return out


# -- the unary calls ---------------------------------------------------------------------------


def scheduler_load(
    stats: EngineStats, num_device_blocks: int, block_size: int
) -> vpb.SchedulerLoad:
    """The engine's snapshot as one (data-parallel rank 0) SchedulerLoad."""
    used_blocks = max(num_device_blocks - stats.free_device_blocks, 0)
    return vpb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=stats.num_running,
        num_waiting_reqs=stats.num_waiting,
        num_total_reqs=stats.num_running + stats.num_waiting,
        num_used_tokens=used_blocks * block_size,
        max_total_num_tokens=num_device_blocks * block_size,
        token_usage=stats.kv_usage,
        cache_hit_rate=stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0,
        num_waiting_uncached_tokens=stats.queued_prefill_tokens,
    )


def tokenizer_bundle(folder: Path) -> tuple[bytes, str]:
    """The tokenizer files of a checkpoint folder (everything but weights) as a zip, and its
    sha256 (hex)."""
    files = sorted(
        p for p in folder.iterdir() if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES)
    )
    if not any(p.name.startswith("tokenizer") for p in files):
        raise FileNotFoundError(f"{folder} holds no tokenizer files")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for p in files:
            z.write(p, p.name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def tokenizer_chunks(
    data: bytes, sha256: str, chunk_bytes: int = TOKENIZER_CHUNK_BYTES
) -> Iterator[common_pb2.GetTokenizerChunk]:
    """The zip in chunks; the last one carries the sha256."""
    starts = range(0, max(len(data), 1), chunk_bytes)
    for i, start in enumerate(starts):
        last = i == len(starts) - 1
        yield common_pb2.GetTokenizerChunk(
            data=data[start : start + chunk_bytes], sha256=sha256 if last else ""
        )


# -- KV events ---------------------------------------------------------------------------------


def block_hash_int64(h: bytes) -> int:
    """deja's block hash (sha256 bytes) as the proto's signed 64-bit hash: its first 8 bytes."""
    return int.from_bytes(h[:8], "big", signed=True)


def kv_event_batch(batch: KvBatch, *, with_tokens: bool) -> common_pb2.KvEventBatch:
    """One numbered batch of the replica's ring in the gateway's shape. A snapshot (`dropped`)
    starts with KvCacheCleared, as the proto's resync does. Without `with_tokens` (auth on),
    stores carry no token ids, as on deja.v1."""
    msg = common_pb2.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp)
    for ev in batch.events:
        msg.events.append(_kv_event(ev, with_tokens))
    return msg


def _kv_event(ev: KVEvent, with_tokens: bool) -> common_pb2.KvCacheEvent:
    if isinstance(ev, AllBlocksCleared):
        return common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())
    tier, level = _TIERS[ev.medium], _CACHE_LEVELS[ev.medium]
    if isinstance(ev, BlockStored):
        bs = ev.block_size
        tokens = ev.token_ids if with_tokens else []
        blocks = [
            common_pb2.KvBlock(
                block_hash=block_hash_int64(h),
                token_ids=tokens[i * bs : (i + 1) * bs],
                block_size=bs,
                cache_level=level,
            )
            for i, h in enumerate(ev.block_hashes)
        ]
        stored = common_pb2.KvBlocksStored(blocks=blocks, tier=tier, medium=ev.medium)
        if ev.parent_block_hash is not None:
            stored.parent_block_hash = block_hash_int64(ev.parent_block_hash)
        return common_pb2.KvCacheEvent(stored=stored)
    removed = common_pb2.KvBlocksRemoved(
        block_hashes=[block_hash_int64(h) for h in ev.block_hashes],
        cache_level=level,
        tier=tier,
        medium=ev.medium,
    )
    return common_pb2.KvCacheEvent(removed=removed)
