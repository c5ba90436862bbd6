"""Tensor parallelism on the CPU (gloo, two ranks): greedy outputs token-identical to one rank
and to transformers (float32) with prefix caching (each batch run twice: the second is served
from the cache), chunked prefill, preemption by recompute and by swap (every rank spills and
restores its own heads through its CPU tier), GQA with fewer KV heads than ranks, q/k/v/o
biases and a vocabulary the ranks do not split evenly; and the shapes it refuses at start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.tiny_models import TOKENIZER_VOCAB_SIZE, build_tiny_llama, build_tiny_qwen2
from engine import LLM, SamplingParams
from tests.engine.test_parity import hf_greedy, shared_prefix_prompts

MAX_TOKENS = 10

CONFIGS: dict[str, dict[str, Any]] = {
    "cache-on": dict(num_device_blocks=256),
    "chunked": dict(num_device_blocks=256, max_num_batched_tokens=64),
    # 10 prompts of up to 255 tokens (16 blocks) cannot all be resident in 24 blocks
    "preempt": dict(num_device_blocks=24, max_num_batched_tokens=64),
    "preempt-swap": dict(
        num_device_blocks=24, max_num_batched_tokens=64, preemption_mode="swap", num_cpu_blocks=256
    ),
}

MODELS: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama-gqa": (build_tiny_llama, {}),
    "qwen2-kv1-odd-vocab": (
        build_tiny_qwen2,
        {"num_key_value_heads": 1, "vocab_size": TOKENIZER_VOCAB_SIZE + 3},
    ),
    "llama-bias": (build_tiny_llama, {"attention_bias": True, "mlp_bias": True}),
}


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(o.finish_reason == "length" for o in outs)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    return [o.token_ids for o in outs]


def check_tp(path: Path, vocab: int, n_prompts: int = 10, max_len: int = 300) -> None:
    prompts = shared_prefix_prompts(vocab, n_prompts, max_len, seed=3)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    one = greedy(LLM(str(path), dtype="float32", **CONFIGS["cache-on"]), prompts)
    assert one == expected, "one rank differs from transformers"
    for name, cfg in CONFIGS.items():
        llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, **cfg)
        for run in range(2 if name == "cache-on" else 1):
            got = greedy(llm, prompts)
            for i, (g, e) in enumerate(zip(got, expected, strict=True)):
                assert g == e, (
                    f"{name} run {run}: prompt {i} ({len(prompts[i])} tokens): {g} != {e}"
                )
        stats = llm.engine.get_stats()
        if name == "cache-on":
            assert stats.prefix_hits > 0
        if name.startswith("preempt"):
            assert stats.num_preemptions > 0, "the small pool should have forced preemption"
        if name == "preempt-swap":
            cpu = next(t for t in stats.tiers if t.name == "cpu")
            assert cpu.swap_ins > 0
        llm.engine.runner.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", list(MODELS))
def test_two_ranks_match_one_and_transformers(model: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    build, overrides = MODELS[model]
    path = build(tmp_path / model, **overrides)
    cfg = AutoConfig.from_pretrained(path)
    if model.startswith("qwen2-kv1"):
        assert cfg.num_key_value_heads < 2 < cfg.num_attention_heads  # KV head replicated
    check_tp(path, min(cfg.vocab_size, TOKENIZER_VOCAB_SIZE))


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_ranks_demo_model(demo_model_path: Path) -> None:
    check_tp(demo_model_path, 49152, n_prompts=6, max_len=200)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 60},
            "not a multiple of 4",
        ),
        ({"num_key_value_heads": 1, "num_attention_heads": 4}, None),
        ({"intermediate_size": 130}, "intermediate_size 130"),
    ],
)
def test_refuses_shapes_that_do_not_split(
    tmp_path: Path, overrides: dict[str, int], message: str | None
) -> None:
    from transformers import AutoConfig

    from engine.worker.parallel.group import check_shapes

    cfg = AutoConfig.from_pretrained(build_tiny_llama(tmp_path / "m", **overrides))
    if message is None:
        check_shapes(cfg, 4, True, "LlamaForCausalLM")  # 1 KV head on 4 ranks: replicated
        return
    with pytest.raises(ValueError, match=message):
        check_shapes(cfg, 4, True, "LlamaForCausalLM")


def test_refuses_other_families_before_starting_workers(tiny_family: Any) -> None:
    with pytest.raises(ValueError, match="not supported with tensor_parallel_size=2"):
        LLM(str(tiny_family("gemma2")), dtype="float32", tensor_parallel_size=2)
