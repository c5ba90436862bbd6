"""Sliding-window models: greedy outputs token-identical to transformers (float32, eager
attention), with prefix caching on (run twice: the second run hits) and off, chunked prefill
and forced preemption; prompts up to ~6x the window so decode and every prefill chunk attend
past released blocks.

Models: a tiny Mistral (every layer slides over 64 positions: the KV manager releases blocks
that fell out of the window) and a tiny Qwen2 with use_sliding_window (layer 0 full, the others
sliding: every block is kept).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.testing.tiny_models import build_tiny_mistral, build_tiny_qwen2_sliding
from tests.support.reference import hf_greedy

WINDOW = 64
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def mistral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mistral(tmp_path_factory.mktemp("tiny-mistral"), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen2_sliding_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_sliding(tmp_path_factory.mktemp("tiny-qwen2-swa"), WINDOW)


def window_prompts(vocab: int, seed: int) -> list[list[int]]:
    """10 prompts of 1..400 tokens (up to ~6x the window) from two shared stems."""
    rng = random.Random(seed)
    stems = [[rng.randrange(10, vocab) for _ in range(400)] for _ in range(2)]
    lengths = [1, 40, 63, 64, 65, 130, 256, 257, 300, 400]
    prompts = []
    for i, n in enumerate(lengths):
        keep = max(0, n - rng.randrange(0, 20))
        prompts.append(stems[i % 2][:keep] + [rng.randrange(10, vocab) for _ in range(n - keep)])
    return prompts


def hf_greedy_eager(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(path, prompts, MAX_TOKENS, attn_implementation="eager")


CONFIGS: dict[str, dict[str, object]] = {
    "cache-on": dict(num_device_blocks=256),
    "cache-off": dict(num_device_blocks=256, enable_prefix_caching=False),
    "chunked": dict(num_device_blocks=256, max_num_batched_tokens=40),
    # 10 prompts of up to 424 tokens cannot all be resident in 40 blocks of 16 tokens.
    "preempt": dict(num_device_blocks=40, max_num_batched_tokens=128),
    # swap preemption and a CPU tier: blocks spill and swap back (the manager keeps every block)
    "swap": dict(
        num_device_blocks=40,
        max_num_batched_tokens=128,
        preemption_mode="swap",
        num_cpu_blocks=256,
    ),
}


def check_parity(path: Path) -> dict[str, LLM]:
    from transformers import AutoConfig

    prompts = window_prompts(AutoConfig.from_pretrained(path).vocab_size, seed=5)
    expected = hf_greedy_eager(path, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engines = {}
    for name, cfg in CONFIGS.items():
        llm = LLM(str(path), dtype="float32", block_size=16, **cfg)  # type: ignore[arg-type]
        runs = 2 if name in ("cache-on", "chunked") else 1
        for run in range(runs):
            got = [o.token_ids for o in llm.generate(prompts, params)]
            for i, (g, e) in enumerate(zip(got, expected, strict=True)):
                assert g == e, (
                    f"{name} run {run}: prompt {i} ({len(prompts[i])} tokens): {g} != {e}"
                )
            llm.engine.core.kv.check_integrity()
            assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
        stats = llm.engine.get_stats()
        if name in ("preempt", "swap"):
            assert stats.num_preemptions > 0, "the small pool should have forced preemption"
        if name == "swap":
            assert llm.engine.core.kv.sliding_window is None
        if name == "cache-off":
            assert stats.prefix_hits == 0
        if name in ("cache-on", "chunked"):
            assert stats.prefix_hits > 0
        engines[name] = llm
    return engines


def test_parity_mistral_sliding_window(mistral_path: Path) -> None:
    engines = check_parity(mistral_path)
    assert engines["cache-on"].engine.core.kv.sliding_window == WINDOW


def test_parity_qwen2_sliding_layers(qwen2_sliding_path: Path) -> None:
    engines = check_parity(qwen2_sliding_path)
    assert (
        engines["cache-on"].engine.core.kv.sliding_window is None
    )  # a full layer keeps all blocks
