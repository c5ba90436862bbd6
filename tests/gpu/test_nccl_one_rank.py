"""Tensor parallelism's NCCL path on one GPU: a one-rank ProcessGroupNCCL runs the parallel
layers (vocab-parallel embedding, column/row-parallel attention and MLP, the vocab all-gather),
every collective going through NCCL. The engine normally takes the single-process path at N = 1;
here the multiprocess executor is built anyway. Its greedy tokens and logprobs must equal the
single-process engine's (float32, eager on both sides: one rank's all-reduce is the identity, so
any difference is the parallel path's own). Several GPUs are needed for N > 1, which this does not cover."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.gpu import GPU_MARKS, cupy_llm

pytest.importorskip("cupy")
pytestmark = GPU_MARKS

import engine.core.engine_core as engine_core  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.executor import UniProcExecutor  # noqa: E402
from engine.executor.multiproc import MultiprocExecutor  # noqa: E402
from engine.testing.tiny_models import build_tiny_llama, build_tiny_qwen2  # noqa: E402
from engine.worker.parallel.group import TPGroup  # noqa: E402
from tests.gpu.test_engine_gpu import shared_prefix_prompts  # noqa: E402

MAX_TOKENS = 16


def _run(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]], LLM]:
    llm = cupy_llm(path, num_device_blocks=1024, max_num_batched_tokens=256, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    eng = llm.engine
    eng.core.kv.check_integrity()
    assert eng.core.kv.num_free_blocks == eng.core.kv.num_blocks
    logprobs = [[lp.logprob for lp in o.outputs[0].logprobs or []] for o in outs]
    return [o.token_ids for o in outs], logprobs, llm


@pytest.mark.parametrize("builder", [build_tiny_llama, build_tiny_qwen2], ids=["llama", "qwen2"])
def test_one_rank_nccl_matches_single_process(
    cuda_device: torch.device,
    builder: object,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = Path(builder(tmp_path, hidden_size=256, num_attention_heads=4))  # type: ignore[operator]
    prompts = shared_prefix_prompts(500)[:10]
    want_tokens, want_logprobs, plain = _run(path, prompts)
    assert isinstance(plain.engine.core.executor, UniProcExecutor)
    plain.engine.close()

    calls = {"all_reduce": 0, "gather_vocab": 0}
    real_reduce, real_gather = TPGroup.all_reduce, TPGroup.gather_vocab

    def all_reduce(self: TPGroup, t: torch.Tensor) -> None:
        calls["all_reduce"] += 1
        real_reduce(self, t)

    def gather_vocab(self: TPGroup, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        calls["gather_vocab"] += 1
        return real_gather(self, local, vocab_size)

    monkeypatch.setattr(TPGroup, "all_reduce", all_reduce)
    monkeypatch.setattr(TPGroup, "gather_vocab", gather_vocab)
    monkeypatch.setattr(engine_core, "make_executor", MultiprocExecutor)
    tokens, logprobs, llm = _run(path, prompts)
    tp = llm.engine.core.executor
    assert isinstance(tp, MultiprocExecutor) and tp.world == 1 and not tp.procs
    assert isinstance(tp.group.pg, dist.ProcessGroupNCCL)
    assert calls["all_reduce"] > 0 and calls["gather_vocab"] > 0, calls
    llm.engine.close()
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs, strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5
