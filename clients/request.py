"""Building the deja.v1 request messages from Python arguments: `build_request` (Generate) and
`tokenize_request` (Tokenize)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from service.api.deja.v1 import inference_pb2 as pb

_SAMPLING_FIELDS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    request_id: str = "",
    session_id: str = "",
    cache_salt: str = "",
    pin_ttl_s: float = 0.0,
    return_token_ids: bool = False,
    logprobs: int | None = None,
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest; `sampling` takes the SamplingParams fields (max_tokens=..., stop=[...]).

    Give exactly one of a text prompt, a list of token ids, or chat `messages`.
    """
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(
            f"unknown sampling fields {sorted(unknown)}; known: {sorted(_SAMPLING_FIELDS)}"
        )
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt (text or token ids) and messages")
    _response_format_fields(sampling)
    req = pb.GenerateRequest(
        request_id=request_id,
        session_id=session_id,
        cache_salt=cache_salt,
        pin_ttl_s=pin_ttl_s,
        return_token_ids=return_token_ids,
        sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
    )
    if logprobs is not None:
        req.logprobs = logprobs
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(prompt)
    else:
        assert messages is not None
        req.chat.messages.extend(
            pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages
        )
    return req


def _response_format_fields(sampling: dict[str, Any]) -> None:
    """Turns the structured-output shorthands into proto fields, in place: json_schema may be a
    dict or a pydantic model class (sent as JSON text), choice a list of strings."""
    schema = sampling.get("json_schema")
    if schema is not None and not isinstance(schema, str):
        to_schema = getattr(schema, "model_json_schema", None)
        sampling["json_schema"] = json.dumps(schema if to_schema is None else to_schema())
    choice = sampling.get("choice")
    if choice is not None and not isinstance(choice, pb.Choices):
        sampling["choice"] = pb.Choices(choices=list(choice))
    if sampling.get("json_object") is False:
        del sampling["json_object"]


def tokenize_request(
    text: str | None, messages: Sequence[dict[str, str]] | None
) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest()
    if text is not None:
        req.text = text
    if messages is not None:
        req.chat.messages.extend(pb.ChatMessage(**m) for m in messages)
    return req
