"""The synchronous engine as a caller uses it: the engine core plus tokenization and validation.

`LLMEngine` is an `EngineCore` (engine/core/engine_core.py) with the front end's
`InputProcessor` and `OutputText` on top: `add_request` tokenizes and validates a prompt, then
queues it; `step` returns streamed deltas, their text made from the core's tokens after the step.
The offline `LLM` and the AsyncEngine's step thread drive one.
"""

from __future__ import annotations

import itertools
from typing import Unpack

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sequence import Request
from engine.frontend.input_processor import InputProcessor, PromptOptions, RequestOptions
from engine.frontend.output_text import OutputText
from engine.frontend.prompt import Prompt
from engine.outputs import RequestOutput
from engine.sample.sampling_params import SamplingParams

__all__ = ["LLMEngine", "Prompt"]


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.inputs = InputProcessor(self.tokenizer, self.model_info, config.scheduler)
        """Tokenizes and validates prompts and sampling parameters (engine/frontend)."""
        self._request_ids = itertools.count()
        self.text = OutputText(self.tokenizer)
        """The text of each queued request's deltas (engine/frontend/output_text.py)."""

    def enqueue(self, req: Request) -> None:
        super().enqueue(req)
        self.text.add(req.request_id, req.prompt_token_ids, req.params)

    def collect_outputs(self, now: float | None = None) -> list[RequestOutput]:
        """The core's deltas (`step` returns these too), with their text."""
        return self.text.apply(super().collect_outputs(now))

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
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.prepare_request(prompt, params, **options)
        self.enqueue(req)
        return req
