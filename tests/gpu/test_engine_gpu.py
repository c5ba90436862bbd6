"""The engine on a GPU with the cupy backend: same greedy tokens as the torch backend (bf16) and
as transformers (float32), on prompts of 1 to 600 tokens that share prefixes."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("cupy")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]

from engine import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import build_tiny_llama, build_tiny_qwen2  # noqa: E402

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
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(MODELS[request.param](tmp_path_factory.mktemp(request.param)))


def _generate(path: Path | str, backend: str, dtype: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(
        model=str(path),
        device="cuda",
        attention_backend=backend,
        dtype=dtype,
        num_device_blocks=1024,
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    vocab = llm.engine.vocab_size
    outputs = llm.generate(shared_prefix_prompts(vocab), params)
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_cupy_matches_torch_backend_bf16(
    cuda_device: torch.device, model_path: Path, chunked: bool
) -> None:
    extra = {"max_num_batched_tokens": 128} if chunked else {}
    cupy = _generate(model_path, "cupy", "bfloat16", **extra)
    ref = _generate(model_path, "torch", "bfloat16", **extra)
    assert cupy == ref


def hf_greedy(path: Path | str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model = model.cuda().eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def test_cupy_matches_transformers_fp32(cuda_device: torch.device, model_path: Path) -> None:
    cupy = _generate(model_path, "cupy", "float32", max_num_batched_tokens=256)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model_path)).vocab_size
    assert cupy == hf_greedy(model_path, shared_prefix_prompts(vocab))


def test_demo_model_cupy_matches_torch_backend_bf16(
    cuda_device: torch.device, demo_model_path: Path
) -> None:
    assert _generate(demo_model_path, "cupy", "bfloat16") == _generate(
        demo_model_path, "torch", "bfloat16"
    )


def test_auto_picks_cupy_on_cuda(cuda_device: torch.device, model_path: Path) -> None:
    llm = LLM(model=str(model_path), device="cuda", dtype="bfloat16", num_device_blocks=64)
    assert llm.engine.backend.name == "cupy"


def test_unsupported_head_dim_falls_back(
    cuda_device: torch.device, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The tiny default Llama (head_dim 16) runs with 'cupy' through the torch fallback."""
    path = build_tiny_llama(tmp_path_factory.mktemp("llama-d16"))
    assert _generate(path, "cupy", "bfloat16") == _generate(path, "torch", "bfloat16")
