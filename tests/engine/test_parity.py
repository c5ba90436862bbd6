"""Greedy outputs are token-identical to transformers `generate` (float32, same weights).

Checked with prefix caching on and off, with a token budget that splits prefills into chunks,
and with a KV pool small enough to force preemption. After every run every block is free.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.support.reference import assert_config_took_effect, hf_greedy

MAX_TOKENS = 12


def shared_prefix_prompts(vocab: int, n: int, max_len: int, seed: int) -> list[list[int]]:
    """n prompts of 1..max_len tokens built from a few shared stems, so they share prefixes."""
    rng = random.Random(seed)
    lo = 10  # stay clear of special tokens at the start of the vocabulary
    stems = [[rng.randrange(lo, vocab) for _ in range(max_len)] for _ in range(3)]
    lengths = [1, 7, 16, 17, 33, 64, 100, 128, 200, 255, 300, 380, 450, 512, 560, max_len]
    prompts = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        stem = stems[i % 3]
        keep = max(0, length - rng.randrange(0, 24))
        prompts.append(stem[:keep] + [rng.randrange(lo, vocab) for _ in range(length - keep)])
    return prompts


CONFIGS = {
    "cache-on": dict(num_device_blocks=512),
    "cache-off": dict(num_device_blocks=512, enable_prefix_caching=False),
    "chunked": dict(num_device_blocks=512, max_num_batched_tokens=96),
    # 16 prompts of up to 600 tokens cannot all be resident in 64 blocks of 16 tokens.
    "preempt": dict(num_device_blocks=64, max_num_batched_tokens=256),
}


def run_engine(path: Path, prompts: list[list[int]], **cfg: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype="float32", block_size=16, **cfg)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(o.finish_reason == "length" for o in outs)
    llm.engine.core.kv.check_integrity()
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
    return [o.token_ids for o in outs], llm


def check_parity(path: Path, vocab: int, backend: str = "auto") -> None:
    prompts = shared_prefix_prompts(vocab, 16, 600, seed=1)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    for name, cfg in CONFIGS.items():
        got, llm = run_engine(path, prompts, attention_backend=backend, **cfg)
        assert backend == "auto" or llm.engine.core.backend.name == backend
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"{name}: prompt {i} ({len(prompts[i])} tokens) differs: {g} != {e}"
        assert_config_took_effect(name, llm.engine.get_stats())


def _backend(name: str) -> str:
    """The attention backend to test; skips "cpu" where its C++ kernel cannot be built."""
    if name == "cpu":
        from engine.worker.attention.cpu_kernel import load_kernel

        kernel = load_kernel()
        if kernel.ops is None:
            pytest.skip(f"CPU attention kernel not built: {kernel.reason}")
    return name


BACKENDS = ["torch", "cpu"]
"""The torch reference and the C++ CPU kernel (the CPU's default when it builds)."""


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_tiny_qwen2_gqa(tiny_qwen2_path: Path, backend: str) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_qwen2_path)
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    check_parity(tiny_qwen2_path, cfg.vocab_size, _backend(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_tiny_llama(tiny_llama_path: Path, backend: str) -> None:
    from transformers import AutoConfig

    check_parity(
        tiny_llama_path, AutoConfig.from_pretrained(tiny_llama_path).vocab_size, _backend(backend)
    )


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_parity_demo_model(demo_model_path: Path) -> None:
    check_parity(demo_model_path, 49152)
