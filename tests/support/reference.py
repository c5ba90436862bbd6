"""transformers' greedy outputs: the reference every engine parity test compares with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_reference(
    path: Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "eager",
    gguf_file: str | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens (`generate`, exactly `max_tokens` new ones) and each chosen
    token's logprob, prompt by prompt. `gguf_file`: a GGUF file in the folder `path`, loaded by
    transformers' own GGUF reader (dequantized)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = (
        {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    )
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.eval()
    tokens, logprobs = [], []
    out: Any
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(  # type: ignore[misc]
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            new = out.sequences[0, len(p) :].tolist()
            steps = [torch.log_softmax(s[0].float(), dim=-1) for s in out.logits]
            tokens.append(new)
            logprobs.append([float(lp[t]) for lp, t in zip(steps, new, strict=True)])
    return tokens, logprobs


def hf_greedy(
    path: Path, prompts: list[list[int]], max_tokens: int, attn_implementation: str | None = None
) -> list[list[int]]:
    """transformers' greedy tokens alone (its default attention unless named)."""
    return hf_reference(path, prompts, max_tokens, attn_implementation=attn_implementation)[0]


def assert_config_took_effect(name: str, stats: Any) -> None:
    """The parity configurations named "preempt", "cache-off" and "cache-on" did what they are
    for (`stats`: the engine's EngineStats after the run): a test that passes without preemption
    or without a prefix hit has not tested them."""
    if name == "preempt":
        assert stats.num_preemptions > 0, "the small pool should have forced preemption"
    if name == "cache-off":
        assert stats.prefix_hits == 0
    if name == "cache-on":
        assert stats.prefix_hits > 0
