"""Weights kept quantized on a GPU (cuda/quant_linear.cu through the cupy backend): a GGUF file's
Q4_0 / Q4_1 / Q4_K / Q8_0 / Q6_K linears (and a tied Q8_0 head) stay 4- and 8-bit on the device, decode takes
the product on the groups and prefill the expansion; greedy float32 tokens against transformers
on the file's dequantized weights on the same GPU (test_engine_gpu's near-tie rule), and bf16
against the same model expanded at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.gpu import GPU_MARKS

pytest.importorskip("cupy")
pytestmark = GPU_MARKS

from engine import LLM, SamplingParams  # noqa: E402
from engine.testing.tiny_gguf import write_gguf  # noqa: E402
from engine.testing.tiny_models import build_tiny_llama, build_tiny_qwen2  # noqa: E402
from engine.worker.models.layers.quantized import GroupedLinear  # noqa: E402
from tests.engine.test_gguf import LLAMA_TYPES, QWEN2_TYPES  # noqa: E402
from tests.gpu import test_engine_gpu as eng  # noqa: E402

D64 = {"hidden_size": 256, "num_attention_heads": 4}
KQUANTS = {"down_proj": "Q6_K", "_proj": "Q4_K", "lm_head": "Q6_K"}
"""A Q4_K_M-like file: float32 scales (and zeros), 16-input Q6_K scales, 2048-input down
projections (64 groups a row: more than a warp's lanes)."""
FILES = {
    "llama-d64": (lambda d: build_tiny_llama(d, **D64), LLAMA_TYPES),
    "qwen2-d64": (lambda d: build_tiny_qwen2(d, **D64), QWEN2_TYPES),
    "llama-kquants": (lambda d: build_tiny_llama(d, intermediate_size=2048, **D64), KQUANTS),
}


@pytest.fixture(scope="module", params=list(FILES))
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    build, types = FILES[request.param]
    src = Path(build(tmp_path_factory.mktemp(request.param)))
    return write_gguf(src, tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", types)


def _generate(file: Path, dtype: str, quantization: str) -> tuple[list[eng.Greedy], int]:
    """Greedy outputs on shared-prefix prompts, and how many layers were kept quantized."""
    llm = LLM(
        model=str(file),
        device="cuda",
        attention_backend="cupy",
        dtype=dtype,
        quantization=quantization,
        num_device_blocks=1024,
        max_num_batched_tokens=256,
    )
    model = llm.engine.core.executor.driver.model
    kept = [m for m in model.modules() if isinstance(m, GroupedLinear)]
    assert all(m.qs.is_cuda and m.has_kernel for m in kept)
    params = SamplingParams(
        temperature=0, max_tokens=eng.MAX_TOKENS, ignore_eos=True, logprobs=eng.TOP
    )
    prompts = eng.shared_prefix_prompts(llm.engine.core.vocab_size)
    return eng.greedy_of(llm.generate(prompts, params)), len(kept)


def test_kept_gguf_matches_transformers_fp32(cuda_device: torch.device, gguf_file: Path) -> None:
    ours, kept = _generate(gguf_file, "float32", "auto")
    assert kept >= 7  # 2 layers x (qkv, o, gate_up) and more: the file's 4- and 8-bit linears
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name).vocab_size
    want = eng.hf_greedy(
        gguf_file.parent, eng.shared_prefix_prompts(vocab), gguf_file=gguf_file.name
    )
    eng.assert_greedy_close(ours, want, eng.LOGPROB_TOL["float32"])


def test_kept_gguf_matches_expanded_bf16(cuda_device: torch.device, gguf_file: Path) -> None:
    kept, n = _generate(gguf_file, "bfloat16", "gguf")
    expanded, none = _generate(gguf_file, "bfloat16", "none")
    assert n >= 7 and none == 0
    eng.assert_greedy_close(kept, expanded, eng.LOGPROB_TOL["bfloat16"])
