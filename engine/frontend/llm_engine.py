"""The synchronous engine as a caller uses it: the engine core in the caller's thread, with the
front end's tokenization and validation before it and the text of its deltas after it.

`LLMEngine` holds an `EngineCore` (engine/core/engine_core.py, `core`), an `InputProcessor` and an
`OutputText`: `add_request` tokenizes and validates a prompt, then queues it in the core; `step`
runs one core step and fills in its deltas' text. The offline `LLM` drives one.
"""

from __future__ import annotations

import itertools
from typing import Any, Unpack

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sequence import Request
from engine.frontend.input_processor import InputProcessor, PromptOptions, RequestOptions
from engine.frontend.output_text import OutputText
from engine.frontend.prompt import Prompt
from engine.outputs import RequestOutput
from engine.sample.sampling_params import SamplingParams
from engine.stats import EngineStats, ModelInfo

__all__ = ["LLMEngine", "Prompt"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.inputs = InputProcessor(self.core.tokenizer, self.core.model_info, config.scheduler)
        """Tokenizes and validates prompts and sampling parameters (engine/frontend)."""
        self.text = OutputText(self.core.tokenizer)
        """The text of each queued request's deltas (engine/frontend/output_text.py)."""
        self._request_ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        return self.core.model_info

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()

    def tokenize(
        self, prompt: Prompt | None = None, messages: list[dict[str, str]] | None = None
    ) -> list[int]:
        return self.inputs.tokenize(prompt, messages)

    def prepare_request(
        self,
        prompt: Prompt | None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        **options: Unpack[PromptOptions],
    ) -> Request:
        """Validates and tokenizes a request without touching engine state (any thread may call).

        Raises ValueError saying what to fix.
        """
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        return self.inputs.prepare(prompt, params, request_id=request_id, **options)

    def add_request(
        self,
        prompt: Prompt | None,
        params: SamplingParams | None = None,
        **options: Unpack[RequestOptions],
    ) -> Request:
        """Validates and queues a request. Raises ValueError (saying what to fix) on bad input."""
        request_id = options.get("request_id")
        if request_id is not None and request_id in self.core.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.prepare_request(prompt, params, **options)
        self.core.enqueue(req)
        self.text.add(req.request_id, req.prompt_token_ids, req.params)
        return req

    def abort(self, request_id: str) -> bool:
        """Finishes the request with reason "abort" and frees its blocks now."""
        return self.core.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """One core step; its deltas with their text."""
        return self.text.apply(self.core.step())

    def collect_outputs(self) -> list[RequestOutput]:
        """The deltas of requests with news since the last step (an abort's), with their text."""
        return self.text.apply(self.core.collect_outputs())

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def close(self, timeout_s: float | None = None) -> bool:
        """EngineCore.close: flushes the disk tier (at most `timeout_s`) and stops helpers."""
        return self.core.close(timeout_s)
