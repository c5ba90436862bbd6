"""Decode CUDA graphs on a GPU: a replay gives the eager forward's tokens and logprobs, the
graphs are used, and --enforce-eager turns them off; async scheduling (steps launched before the
last one's ids are read, their input ids gathered on the device) changes no output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.gpu import GPU_MARKS, cupy_llm

pytest.importorskip("cupy")
pytestmark = GPU_MARKS

from engine import SamplingParams  # noqa: E402
from engine.testing.tiny_models import build_tiny_llama, build_tiny_qwen2_sliding  # noqa: E402
from tests.gpu.test_engine_gpu import (  # noqa: E402
    LOGPROB_TOL,
    Greedy,
    assert_greedy_close,
    greedy_of,
)

MAX_TOKENS = 24


def _run(
    path: Path,
    prompts: list[list[int]],
    dtype: str,
    eager: bool,
    max_tokens: list[int],
    async_scheduling: bool = False,
) -> tuple[list[Greedy], int]:
    llm = cupy_llm(
        path,
        dtype=dtype,
        num_device_blocks=512,
        max_num_seqs=64,
        enforce_eager=eager,
        async_scheduling=async_scheduling,
    )
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=5) for m in max_tokens
    ]
    outs = llm.generate(prompts, params)
    graphs = llm.engine.core.runner.graphs
    assert (graphs is None) == eager
    replays = 0 if graphs is None else graphs.replays
    result = greedy_of(outs)
    eng = llm.engine
    assert eng.core.kv.num_free_blocks == eng.core.kv.num_blocks
    eng.close()
    return result, replays


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(
        build_tiny_llama(tmp_path_factory.mktemp("llama"), hidden_size=256, num_attention_heads=4)
    )


def _prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_replay_is_token_exact_with_eager_at_a_graph_size(llama: Path, dtype: str) -> None:
    """8 prompts of one length decode together at batch 8, a captured size: the replay runs the
    very launches the eager forward runs, so tokens and logprobs are bit-identical."""
    prompts = _prompts(8, [40])
    graph, replays = _run(llama, prompts, dtype, False, [MAX_TOKENS] * 8)
    eager, _ = _run(llama, prompts, dtype, True, [MAX_TOKENS] * 8)
    assert replays >= MAX_TOKENS - 2
    assert [g.tokens for g in graph] == [e.tokens for e in eager]
    assert [g.logprobs for g in graph] == [e.logprobs for e in eager]


def test_padded_replays_match_eager(llama: Path) -> None:
    """Ragged prompts and outputs: the batch shrinks step by step through padded sizes (13 in a
    graph of 16, 5 in 8, 3 in 4). Float32: same tokens, logprobs within float rounding."""
    prompts = _prompts(13, [3, 17, 64, 100, 250])
    max_tokens = [4 + 3 * i for i in range(13)]
    graph, replays = _run(llama, prompts, "float32", False, max_tokens)
    eager, _ = _run(llama, prompts, "float32", True, max_tokens)
    assert replays > 20
    assert [g.tokens for g in graph] == [e.tokens for e in eager]
    for g, e in zip(graph, eager, strict=True):
        assert max(abs(a - b) for a, b in zip(g.logprobs, e.logprobs, strict=True)) < 1e-3


def test_padded_replays_bf16_and_sliding_window(tmp_path: Path) -> None:
    """bf16 with a sliding window on some layers: padded replays agree with eager up to near-ties
    (bf16 GEMMs of another row count may round differently)."""
    path = Path(build_tiny_qwen2_sliding(tmp_path, 64, hidden_size=256))
    prompts = _prompts(11, [5, 60, 130, 300])
    max_tokens = [8 + 7 * i for i in range(11)]
    graph, replays = _run(path, prompts, "bfloat16", False, max_tokens)
    eager, _ = _run(path, prompts, "bfloat16", True, max_tokens)
    assert replays > 20
    assert_greedy_close(graph, eager, LOGPROB_TOL["bfloat16"])


def test_replay_is_token_exact_on_the_1b_bench_model(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`deja bench gpu`'s random Llama-3.2-1B-shaped model (bf16, 16 layers, GQA 4): 16 prompts of
    one length decoding together at batch 16, a captured size, give eager decode's tokens and
    logprobs bit for bit. (Its mixed workload, where a shrinking batch replays padded sizes, parts
    at near-ties: README, "Decode CUDA graphs on a GPU".)"""
    import os

    from engine.testing.tiny_models import ensure_random_llama

    cache = Path(os.environ.get("DEJA_CACHE_DIR") or tmp_path_factory.mktemp("deja-cache"))
    path = ensure_random_llama(cache, "bfloat16")
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 128000) for _ in range(100)] for _ in range(16)]
    graph, replays = _run(path, prompts, "bfloat16", False, [MAX_TOKENS] * 16)
    eager, _ = _run(path, prompts, "bfloat16", True, [MAX_TOKENS] * 16)
    assert replays >= MAX_TOKENS - 2
    assert [g.tokens for g in graph] == [e.tokens for e in eager]
    assert [g.logprobs for g in graph] == [e.logprobs for e in eager]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_async_scheduling_changes_no_output(llama: Path, dtype: str) -> None:
    """Ragged prompts and outputs (the batch shrinks through padded graph sizes), graphs and
    eager: with async scheduling every step's input ids of a running sample come from the step
    before's sampled ids on the device; the batches are the same (every sample ends by length,
    known ahead), so tokens and logprobs are bit-identical to waiting for each step."""
    prompts = _prompts(13, [3, 17, 64, 100, 250])
    max_tokens = [4 + 3 * i for i in range(13)]
    for eager in (False, True):
        sync, _ = _run(llama, prompts, dtype, eager, max_tokens)
        overlapped, replays = _run(llama, prompts, dtype, eager, max_tokens, True)
        assert eager or replays > 20
        assert [a.tokens for a in overlapped] == [s.tokens for s in sync]
        assert [a.logprobs for a in overlapped] == [s.logprobs for s in sync]


def test_async_scheduling_with_stops_and_sampling(llama: Path) -> None:
    """Stop tokens end samples while their next token is in flight; seeded sampling with
    top-p: the same tokens as waiting for each step (float32)."""
    prompts = _prompts(12, [5, 40, 90])
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            top_p=1.0 if i % 2 else 0.9,
            seed=None if i % 2 else i,
            max_tokens=30,
            stop_token_ids=list(range(10 + i, 500, 37)),
        )
        for i in range(12)
    ]
    results = []
    for mode in (False, True):
        llm = cupy_llm(llama, num_device_blocks=512, async_scheduling=mode)
        outs = llm.generate(prompts, params)
        results.append([(o.token_ids, o.finish_reason) for o in outs])
        assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
        llm.engine.close()
    assert results[0] == results[1]
    assert any(reason == "stop" for _, reason in results[1])
