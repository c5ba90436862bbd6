"""Each family beyond Llama and Qwen2 against transformers, end to end through the engine.

Greedy float32 tokens are identical to transformers `generate` with eager attention, and each
chosen token's logprob is within 1e-3 of transformers', with prefix caching on (the same prompts
run twice, the second time from the cache), caching off, chunked prefill (a 48-token budget) and
a KV pool small enough to force preemption. After every run every block is free. The Gemmas
slide over 32 positions on their local layers: the prompts run to 300 tokens, past 4x that.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.testing.tiny_models import FAMILY_BUILDERS
from tests.support.reference import assert_config_took_effect, hf_reference

MAX_TOKENS = 10
LOGPROB_TOL = 1e-3
PROMPT_LENGTHS = (1, 17, 40, 64, 100, 150, 230, 300)
CONFIGS: dict[str, dict[str, object]] = {
    "cache-on": dict(num_device_blocks=256),
    "cache-off": dict(num_device_blocks=256, enable_prefix_caching=False),
    "chunked": dict(num_device_blocks=256, max_num_batched_tokens=48),
    # 8 prompts of up to 310 tokens cannot all be resident in 24 blocks of 16 tokens.
    "preempt": dict(num_device_blocks=24, max_num_batched_tokens=256),
}


def family_prompts(
    vocab: int, seed: int, lengths: tuple[int, ...] = PROMPT_LENGTHS
) -> list[list[int]]:
    """Prompts of the given lengths cut from two shared stems (so they share prefixes), each
    with a few tokens of its own at the end."""
    rng = random.Random(seed)
    lo = 10  # clear of the special tokens at the start of the vocabulary
    stems = [[rng.randrange(lo, vocab) for _ in range(max(lengths))] for _ in range(2)]
    prompts = []
    for i, length in enumerate(lengths):
        keep = max(0, length - rng.randrange(1, 8))
        own = [rng.randrange(lo, vocab) for _ in range(length - keep)]
        prompts.append(stems[i % 2][:keep] + own)
    return prompts


def engine_run(
    llm: LLM, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    assert all(o.finish_reason == "length" for o in outs)
    llm.engine.core.kv.check_integrity()
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
    logprobs = [[lp.logprob for lp in o.outputs[0].logprobs or []] for o in outs]
    return [o.token_ids for o in outs], logprobs


def check_family_parity(
    path: Path, prompts: list[list[int]], configs: dict[str, dict[str, object]]
) -> None:
    want_tokens, want_logprobs = hf_reference(path, prompts, MAX_TOKENS)
    for name, cfg in configs.items():
        llm = LLM(str(path), dtype="float32", block_size=16, **cfg)  # type: ignore[arg-type]
        runs = 2 if name == "cache-on" else 1
        for run in range(runs):
            tokens, logprobs = engine_run(llm, prompts, MAX_TOKENS)
            for i, (got, want) in enumerate(zip(tokens, want_tokens, strict=True)):
                where = f"{name} run {run}: prompt {i} ({len(prompts[i])} tokens)"
                assert got == want, f"{where} differs: {got} != {want}"
                diff = max(abs(a - b) for a, b in zip(logprobs[i], want_logprobs[i], strict=True))
                assert diff <= LOGPROB_TOL, f"{where}: logprob off by {diff:.2e}"
        assert_config_took_effect(name, llm.engine.get_stats())


@pytest.mark.parametrize("family", sorted(FAMILY_BUILDERS))
def test_family_matches_transformers(family: str, tiny_family: Callable[[str], Path]) -> None:
    from transformers import AutoConfig

    path = tiny_family(family)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    check_family_parity(path, family_prompts(vocab, seed=3), CONFIGS)
