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
) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens (`generate`, exactly `max_tokens` new ones) and each chosen
    token's logprob, prompt by prompt."""
    from transformers import AutoModelForCausalLM

    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
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
