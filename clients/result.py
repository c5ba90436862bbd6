"""A Generate stream collected: `GenerateResult` with its `Choice`s, and `collector`, which
builds one from the streamed messages."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.api.deja.v1 import inference_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}


def _schema_model(kwargs: dict[str, Any]) -> Any:
    """The pydantic model class given as json_schema, if any (to parse the reply with)."""
    schema = kwargs.get("json_schema")
    return schema if isinstance(schema, type) else None


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    """stop, length, abort or error."""
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    """Sum of its token logprobs (beam search, best_of > n, or with logprobs)."""


@dataclass(slots=True)
class GenerateResult:
    """A whole Generate stream, collected."""

    request_id: str = ""
    choices: list[Choice] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    final: pb.Final | None = None
    """Usage, timings, replica id, route (None if the stream ended without one)."""
    num_messages: int = 0
    ttft_s: float | None = None
    """Client-side: from the call to the first message carrying a token (text, token ids or
    logprobs; ask for return_token_ids to see a token whose text is still held back). None when
    no token came."""
    total_s: float = 0.0
    response_model: Any = None
    """The pydantic model class given as json_schema (complete() sets it); parse() builds it."""

    def parse(self, index: int = 0) -> Any:
        """A choice's text parsed as JSON: an instance of `response_model` when one was given,
        else the plain JSON value. Raises ValueError when the choice did not finish with "stop"
        (a `length` finish holds partial JSON)."""
        c = self.choices[index]
        if c.finish_reason != "stop":
            raise ValueError(f"choice {index} ended with {c.finish_reason!r}; its JSON is partial")
        if self.response_model is not None:
            return self.response_model.model_validate_json(c.text)
        return json.loads(c.text)

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids if self.choices else []

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def usage(self) -> pb.Usage:
        return self.final.usage if self.final is not None else pb.Usage()

    @property
    def timings(self) -> pb.Timings:
        return self.final.timings if self.final is not None else pb.Timings()

    def add(self, msg: pb.GenerateResponse, *, elapsed_s: float) -> None:
        self.request_id = msg.request_id
        self.num_messages += 1
        self.prompt_token_ids.extend(msg.prompt_token_ids)
        for d in msg.choices:
            while len(self.choices) <= d.index:
                self.choices.append(Choice(index=len(self.choices)))
            c = self.choices[d.index]
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            c.logprobs.extend(d.logprobs)
            if d.finish_reason:
                c.finish_reason = FINISH_REASONS[d.finish_reason]
            if d.HasField("cumulative_logprob"):
                c.cumulative_logprob = d.cumulative_logprob
            which = d.WhichOneof("stop_reason")
            if which is not None:
                c.stop_reason = getattr(d, which)
            if self.ttft_s is None and (d.text or d.token_ids or d.logprobs):
                self.ttft_s = elapsed_s
        if msg.HasField("final"):
            self.final = msg.final
            for end in msg.final.choices:
                while len(self.choices) <= end.index:
                    self.choices.append(Choice(index=len(self.choices)))
                self.choices[end.index].finish_reason = FINISH_REASONS[end.finish_reason]
        self.total_s = elapsed_s


def collector(
    kwargs: dict[str, Any],
) -> tuple[GenerateResult, Callable[[pb.GenerateResponse], None]]:
    """What `complete` returns, and the function that adds each streamed message to it."""
    result = GenerateResult(response_model=_schema_model(kwargs))
    t0 = time.monotonic()
    return result, lambda msg: result.add(msg, elapsed_s=time.monotonic() - t0)
