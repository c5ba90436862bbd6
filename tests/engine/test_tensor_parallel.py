"""Tensor parallelism on the CPU (gloo, two ranks): greedy outputs token-identical to one rank
and to transformers (float32) with prefix caching (each batch run twice: the second is served
from the cache), chunked prefill, preemption by recompute and by swap (every rank spills and
restores its own heads through its CPU tier), GQA with fewer KV heads than ranks, KV heads the
ranks do not split evenly (3 over 2: 6 / 3 query heads, 2 / 1 KV heads, as SmolLM2's 9 / 3),
q/k/v/o biases and a vocabulary the ranks do not split evenly; and the shapes it refuses at
start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.testing.tiny_models import TOKENIZER_VOCAB_SIZE, build_tiny_llama, build_tiny_qwen2
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
    "llama-uneven-heads": (
        build_tiny_llama,
        {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
    ),
}


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(o.finish_reason == "length" for o in outs)
    llm.engine.core.kv.check_integrity()
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
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
        llm.engine.core.executor.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", list(MODELS))
def test_two_ranks_match_one_and_transformers(model: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    build, overrides = MODELS[model]
    path = build(tmp_path / model, **overrides)
    cfg = AutoConfig.from_pretrained(path)
    if model.startswith("qwen2-kv1"):
        assert cfg.num_key_value_heads < 2 < cfg.num_attention_heads  # KV head replicated
    if model == "llama-uneven-heads":
        assert cfg.num_key_value_heads % 2 == 1  # rank 0 holds 2 KV heads, rank 1 one
    check_tp(path, min(cfg.vocab_size, TOKENIZER_VOCAB_SIZE))


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_ranks_demo_model(demo_model_path: Path) -> None:
    # 9 query / 3 KV heads: rank 0 holds 6 / 2, rank 1 3 / 1
    check_tp(demo_model_path, 49152)  # the tiny models' prompts: the 24-block pool preempts


def test_uneven_head_split() -> None:
    from engine.worker.parallel.group import kv_head_range, q_head_range

    # SmolLM2-135M: 9 query heads, 3 KV heads
    assert [kv_head_range(3, r, 2) for r in range(2)] == [(0, 2), (2, 1)]
    assert [q_head_range(9, 3, r, 2) for r in range(2)] == [(0, 6), (6, 3)]
    assert [kv_head_range(6, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 1)]
    assert [q_head_range(12, 6, r, 4) for r in range(4)] == [(0, 4), (4, 4), (8, 2), (10, 2)]
    # fewer KV heads than ranks: replicated, the query heads split evenly
    assert [kv_head_range(1, r, 2) for r in range(2)] == [(0, 1), (0, 1)]
    assert [q_head_range(4, 1, r, 2) for r in range(2)] == [(0, 2), (2, 2)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # 6 KV heads over 4 ranks: [2, 2, 1, 1], each rank its groups' query heads
        ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 60}, None),
        ({"num_key_value_heads": 1, "num_attention_heads": 4}, None),  # replicated
        (
            {"num_key_value_heads": 3, "num_attention_heads": 6, "hidden_size": 96},
            "cannot replicate num_key_value_heads 3",
        ),
        (
            {"num_key_value_heads": 2, "num_attention_heads": 6, "hidden_size": 96},
            "num_attention_heads 6 is not a multiple of 4",
        ),
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


@pytest.mark.timeout(900)
def test_two_ranks_fp8_kv_cache(tmp_path: Path) -> None:
    """fp8_e4m3 KV: the calibration pass runs on both ranks and takes each layer's maximum over
    them, so the scales are one rank's and the outputs the one-rank fp8 engine's, through the
    CPU tier (swap preemption) and the disk tier (restart: the scales of rank 0's folder)."""
    path = build_tiny_llama(
        tmp_path / "m", hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    )
    prompts = shared_prefix_prompts(TOKENIZER_VOCAB_SIZE, 10, 300, seed=3)
    fp8: dict[str, Any] = dict(dtype="float32", kv_cache_dtype="fp8_e4m3")
    one = LLM(str(path), **fp8, **CONFIGS["cache-on"])
    expected = greedy(one, prompts)
    assert (
        one.engine.core.kv_scales is not None and one.engine.core.kv_scales.source == "calibrated"
    )
    swap = LLM(str(path), tensor_parallel_size=2, **fp8, **CONFIGS["preempt-swap"])
    assert greedy(swap, prompts) == expected
    assert swap.engine.core.kv_scales == one.engine.core.kv_scales
    assert swap.engine.get_stats().num_preemptions > 0
    swap.engine.core.executor.close()
    disk = str(tmp_path / "disk")
    for run in ("write", "restart"):
        llm = LLM(str(path), tensor_parallel_size=2, num_cpu_blocks=64, disk_dir=disk, **fp8)
        assert llm.engine.core.kv_scales is not None
        assert llm.engine.core.kv_scales.source == ("calibrated" if run == "write" else "disk")
        assert greedy(llm, prompts) == expected
        if run == "restart":
            disk_tier = next(t for t in llm.engine.get_stats().tiers if t.name == "disk")
            assert disk_tier.hits > 0
        assert llm.engine.close(timeout_s=30.0)
