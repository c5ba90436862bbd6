"""Turns a caller's prompt and sampling parameters into a validated, tokenized `Request`.

Pure with respect to engine state: it needs only the tokenizer, the model's facts and the
scheduler limits, so it runs wherever the caller is — in `LLMEngine` for the offline API, and in
the API-server process when the engine core runs in a process of its own
(`engine/frontend/core_client.py`). A prepared request is picklable: it carries token ids, parameters and
timestamps, never tensors (per-sample torch generators are made by the worker).
"""

from __future__ import annotations

import time
from typing import Any, TypedDict

from engine.config import SchedulerConfig
from engine.core.sequence import Request
from engine.frontend.prompt import Prompt, prompt_hash_extra, tokenize_prompt
from engine.outputs import RequestMetrics
from engine.sample.sampling_params import SamplingParams
from engine.sample.structured.compiler import validate_response_format
from engine.stats import ModelInfo


class PromptOptions(TypedDict, total=False):
    """What comes with a prompt besides its sampling parameters and request id: keywords of
    `InputProcessor.prepare` that `LLMEngine.prepare_request` and `add_request` pass on."""

    messages: list[dict[str, str]] | None
    """Chat messages to render with the chat template, instead of a prompt."""
    cache_salt: str | None
    """Mixed into the prompt's block hashes: only requests with the same salt share its cache."""
    arrival: float | None
    """time.monotonic() when the request arrived; None: now."""


class RequestOptions(PromptOptions, total=False):
    """The keywords of `LLMEngine.add_request`: the prompt's options and the request id."""

    request_id: str | None
    """None: the engine names the request."""


class InputProcessor:
    def __init__(self, tokenizer: Any, model_info: ModelInfo, limits: SchedulerConfig) -> None:
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.limits = limits

    def tokenize(
        self, prompt: Prompt | None = None, messages: list[dict[str, str]] | None = None
    ) -> list[int]:
        """Token ids of text, of chat messages (chat template applied), or ids as given."""
        return tokenize_prompt(self.tokenizer, prompt, messages)

    def validate_params(self, params: SamplingParams) -> None:
        lim = self.limits
        params.validate(
            vocab_size=self.model_info.vocab_size,
            max_n=lim.max_n,
            max_logprobs=lim.max_logprobs,
        )
        if params.response_format is not None:
            validate_response_format(params.response_format)
        if params.use_beam_search and self.model_info.speculative_method is not None:
            raise ValueError(
                "beam search cannot be combined with speculative decoding: this server runs "
                f"--speculative-config method {self.model_info.speculative_method!r}; send the "
                "request without use_beam_search, or to a server without speculation"
            )
        if params.use_beam_search:
            # A group's beams run in lockstep: all of them in one step's budget and batch.
            cap = min(lim.max_num_seqs, lim.max_num_batched_tokens)
            if params.beam_width > cap:
                raise ValueError(
                    f"beam width {params.beam_width} exceeds what one step can run "
                    f"(max_num_seqs {lim.max_num_seqs}, max_num_batched_tokens "
                    f"{lim.max_num_batched_tokens})"
                )

    def prepare(
        self,
        prompt: Prompt | None,
        params: SamplingParams | None,
        *,
        request_id: str,
        messages: list[dict[str, str]] | None = None,
        cache_salt: str | None = None,
        arrival: float | None = None,
    ) -> Request:
        """A validated request, not yet queued. Raises ValueError saying what to fix."""
        params = params or SamplingParams()
        self.validate_params(params)
        token_ids = self.tokenize(prompt, messages)
        info = self.model_info
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = next((t for t in token_ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
        if len(token_ids) >= info.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {info.max_model_len}: "
                "shorten the prompt so that at least one token can be generated"
            )
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            hash_extra=prompt_hash_extra(info.model_id, cache_salt),
            # NOTE: time.monotonic() is CLOCK_MONOTONIC, shared by every process on the host, so
            # an arrival stamped in the API server is comparable with the engine core's clock.
            metrics=RequestMetrics(arrival=arrival if arrival is not None else time.monotonic()),
        )
