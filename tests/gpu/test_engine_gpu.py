"""The engine on a GPU with the cupy backend: same greedy tokens as the torch backend (bf16) and
as transformers (float32), on prompts of 1 to 600 tokens that share prefixes.

Random tiny models have flat logits, so two correct implementations that round differently
can pick different tokens where the top two are nearly tied, and the outputs go apart from there.
"Same greedy tokens" is checked the way that allows for this: up to the first difference the
chosen tokens' logprobs agree within a tolerance, and at the first difference each side's token is
within that tolerance of the other side's best (a near-tie), which a wrong kernel does not give."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.gpu import GPU_MARKS

pytest.importorskip("cupy")
pytestmark = GPU_MARKS

from engine import LLM, RequestOutput, SamplingParams  # noqa: E402
from engine.testing.tiny_models import (  # noqa: E402
    build_tiny_llama,
    build_tiny_mistral,
    build_tiny_qwen2,
    build_tiny_qwen2_sliding,
)

MAX_TOKENS = 32
LENGTHS = [1, 7, 16, 17, 33, 64, 100, 128, 200, 255, 300, 380, 450, 512, 560, 600]


def shared_prefix_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """16 prompts of 1..600 tokens cut from three shared stems, each with its own tail."""
    rng = random.Random(seed)
    stems = [[rng.randrange(10, vocab) for _ in range(600)] for _ in range(3)]
    prompts = []
    for i, length in enumerate(LENGTHS):
        keep = max(0, length - rng.randrange(0, 24))
        prompts.append(
            stems[i % 3][:keep] + [rng.randrange(10, vocab) for _ in range(length - keep)]
        )
    return prompts


# head_dim 64 and 128 (the tiny defaults have head_dim 16, which the kernels do not cover)
MODELS = {
    "llama-d64": lambda d: build_tiny_llama(d, hidden_size=256, num_attention_heads=4),
    "llama-d128-gqa4": lambda d: build_tiny_llama(
        d, hidden_size=512, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=3
    ),
    "qwen2-d64": lambda d: build_tiny_qwen2(d, hidden_size=256, num_attention_heads=4),
    # sliding window 64 on every layer (the KV manager releases blocks) / on layers 1-2 only
    "mistral-d64-w64": lambda d: build_tiny_mistral(d, 64, hidden_size=256),
    "qwen2-d64-swa64": lambda d: build_tiny_qwen2_sliding(d, 64, hidden_size=256),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(MODELS[request.param](tmp_path_factory.mktemp(request.param)))


LOGPROB_TOL = {"bfloat16": 0.5, "float32": 2e-3}
"""Largest logprob difference allowed between two implementations (and near-tie width). bf16:
two bf16 runs differ by up to the sum of their own errors against float32 (seen on an H100: 0.30
between the cupy and torch backends, on the GQA-4 head_dim-128 model); logits of magnitude 16..32
alone are rounded to steps of 0.125. test_cupy_matches_torch_backend_bf16 also checks that the
cupy backend's bf16 logprobs are as close to float32 as the torch backend's."""
TOP = 5


@dataclass
class Greedy:
    """One request's greedy tokens with, per step, the chosen logprob and the top TOP."""

    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]


def _generate(path: Path | str, backend: str, dtype: str, **kwargs: object) -> list[Greedy]:
    llm = LLM(
        model=str(path),
        device="cuda",
        attention_backend=backend,
        dtype=dtype,
        num_device_blocks=1024,
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    vocab = llm.engine.core.vocab_size
    return greedy_of(llm.generate(shared_prefix_prompts(vocab), params))


def greedy_of(outputs: list[RequestOutput]) -> list[Greedy]:
    """Each request's first sample's tokens, chosen logprobs and top logprobs."""
    result = []
    for out in outputs:
        o = out.outputs[0]
        assert o.logprobs is not None
        result.append(
            Greedy(
                list(o.token_ids),
                [lp.logprob for lp in o.logprobs],
                [dict(lp.top) for lp in o.logprobs],
            )
        )
    return result


def assert_greedy_close(ours: list[Greedy], ref: list[Greedy], tol: float) -> None:
    """Same tokens up to a near-tie; logprobs within tol on the shared part (module docstring)."""
    assert len(ours) == len(ref)
    identical = 0
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        n = next(
            (t for t, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)) if x != y), None
        )
        shared = len(a.tokens) if n is None else n
        for t in range(shared):
            diff = abs(a.logprobs[t] - b.logprobs[t])
            assert diff <= tol, f"request {i} step {t}: logprob {a.logprobs[t]} vs {b.logprobs[t]}"
        if n is None:
            identical += 1
            continue
        ta, tb = a.tokens[n], b.tokens[n]
        for name, run, token in (("ours", a, tb), ("ref", b, ta)):
            assert token in run.top[n], (
                f"request {i} step {n}: {name} does not rank the other side's token {token} "
                f"in its top {TOP}: {run.top[n]}"
            )
            gap = run.logprobs[n] - run.top[n][token]
            assert gap <= tol, (
                f"request {i} step {n}: not a near-tie, {name} prefers {run.tokens[n]} over "
                f"{token} by {gap:.4f} (tolerance {tol})"
            )
    print(f"{identical}/{len(ours)} requests identical, the rest part at a near-tie")


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_cupy_matches_torch_backend_bf16(
    cuda_device: torch.device, model_path: Path, chunked: bool
) -> None:
    extra = {"max_num_batched_tokens": 128} if chunked else {}
    cupy = _generate(model_path, "cupy", "bfloat16", **extra)
    ref = _generate(model_path, "torch", "bfloat16", **extra)
    exact = _generate(model_path, "torch", "float32", **extra)
    # Accuracy: on the steps where all three runs chose the same tokens so far, the cupy
    # backend's bf16 logprobs are (on average) no further from float32 than the torch backend's.
    ours_err: list[float] = []
    ref_err: list[float] = []
    for c, r, e in zip(cupy, ref, exact, strict=True):
        for t, (x, y, z) in enumerate(zip(c.tokens, r.tokens, e.tokens, strict=True)):
            if not x == y == z:
                break
            ours_err.append(abs(c.logprobs[t] - e.logprobs[t]))
            ref_err.append(abs(r.logprobs[t] - e.logprobs[t]))
    assert ours_err, "every request parted at its first token"
    mean_ours, mean_ref = sum(ours_err) / len(ours_err), sum(ref_err) / len(ref_err)
    print(
        f"bf16 logprob error vs float32 over {len(ours_err)} steps: cupy mean {mean_ours:.4f} "
        f"max {max(ours_err):.4f}, torch mean {mean_ref:.4f} max {max(ref_err):.4f}"
    )
    assert mean_ours <= 1.25 * mean_ref + 1e-3
    assert_greedy_close(cupy, ref, LOGPROB_TOL["bfloat16"])


def hf_greedy(path: Path | str, prompts: list[list[int]], **model_kwargs: Any) -> list[Greedy]:
    """transformers' forward with its KV cache, argmax of the raw logits at every step
    (`model_kwargs` go to from_pretrained, e.g. attn_implementation).

    NOTE: not `generate`: its min_new_tokens (the counterpart of ignore_eos) masks EOS, which the
    engine with ignore_eos may still pick greedily.
    """
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, **model_kwargs
    )
    model = model.cuda().eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = model(torch.tensor([p], device="cuda"), use_cache=True)
            tokens: list[int] = []
            chosen: list[float] = []
            top: list[dict[int, float]] = []
            for _ in range(MAX_TOKENS):
                lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                values, ids = lp.topk(TOP)
                token = int(ids[0])
                tokens.append(token)
                chosen.append(float(values[0]))
                top.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
                out = model(
                    torch.tensor([[token]], device="cuda"),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
            outs.append(Greedy(tokens, chosen, top))
    return outs


def test_cupy_matches_transformers_fp32(cuda_device: torch.device, model_path: Path) -> None:
    cupy = _generate(model_path, "cupy", "float32", max_num_batched_tokens=256)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model_path)).vocab_size
    ref = hf_greedy(model_path, shared_prefix_prompts(vocab))
    assert_greedy_close(cupy, ref, LOGPROB_TOL["float32"])


def test_demo_model_cupy_matches_torch_backend_bf16(
    cuda_device: torch.device, demo_model_path: Path
) -> None:
    cupy = _generate(demo_model_path, "cupy", "bfloat16")
    assert_greedy_close(
        cupy, _generate(demo_model_path, "torch", "bfloat16"), LOGPROB_TOL["bfloat16"]
    )


def test_auto_picks_cupy_on_cuda(cuda_device: torch.device, model_path: Path) -> None:
    llm = LLM(model=str(model_path), device="cuda", dtype="bfloat16", num_device_blocks=64)
    assert llm.engine.core.backend.name == "cupy"


def test_unsupported_head_dim_falls_back(
    cuda_device: torch.device, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The tiny default Llama (head_dim 16) runs with 'cupy' through the torch fallback."""
    path = build_tiny_llama(tmp_path_factory.mktemp("llama-d16"))
    cupy = _generate(path, "cupy", "bfloat16")
    assert_greedy_close(cupy, _generate(path, "torch", "bfloat16"), LOGPROB_TOL["bfloat16"])


def test_fp8_cache_cupy_matches_torch_backend(cuda_device: torch.device, model_path: Path) -> None:
    """An fp8 (e4m3) KV cache through the cupy kernels (decode graphs included) against the torch
    reference reading the same kind of cache, bf16: same tokens up to near-ties. fp8 rounds K and
    V to 3 mantissa bits, so both sides sit further from float32 than a bf16 cache does; the
    check is that the kernels read and write the quantized cache as the reference does."""
    cupy = _generate(model_path, "cupy", "bfloat16", kv_cache_dtype="fp8_e4m3")
    ref = _generate(model_path, "torch", "bfloat16", kv_cache_dtype="fp8_e4m3")
    assert_greedy_close(cupy, ref, LOGPROB_TOL["bfloat16"])
