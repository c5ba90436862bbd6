"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`, as in vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.frontend.llm_engine import LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sample.sampling_params import SamplingParams, apply_defaults


class LLM:
    """Runs batches of prompts to completion on one engine.

    `LLM(model=path, **config fields)`: any field of EngineConfig's parts (block_size,
    num_device_blocks, max_num_batched_tokens, dtype, ...) may be given by name.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the model's
        generation_config.json settings (ModelInfo.sampling_defaults) over the neutral ones, as
        vLLM's LLM.get_default_sampling_params."""
        defaults = dict(self.engine.core.model_info.sampling_defaults)
        return apply_defaults(SamplingParams(), defaults, defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """One cumulative output per prompt, in prompt order.

        `prompts` is a string, a list of token ids, or a list of either; `sampling_params` is one
        SamplingParams for all prompts or a list with one per prompt.
        """
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.default_sampling_params()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts; "
                    "give one for all or one per prompt"
                )
        # Validate everything before queueing anything.
        for p in params_list:
            self.engine.inputs.validate_params(p)  # ranges, and response_format's grammar
        ids = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                req = self.engine.add_request(prompt, params, cache_salt=cache_salt)
                ids.append(req.request_id)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                _accumulate(results, delta)
        return [results[rid] for rid in ids]


def _accumulate(results: dict[str, RequestOutput], delta: RequestOutput) -> None:
    """Adds a step's delta to its request's whole output (`RequestOutput.merge`)."""
    acc = results.get(delta.request_id)
    if acc is None:  # the engine made the delta for this step alone: it becomes the whole
        results[delta.request_id] = acc = delta
    else:
        acc.merge(delta)
    if len(acc.outputs) > 1:
        acc.outputs.sort(key=lambda o: o.index)
