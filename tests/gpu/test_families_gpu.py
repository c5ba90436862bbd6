"""Each family beyond Llama and Qwen2 on a GPU with the cupy backend, float32, against
transformers on the same GPU: the same greedy tokens up to near-ties (test_engine_gpu's rule),
with whole and chunked prefill. The models have head_dim 64, which the CUDA kernels cover, so
attention runs deja's kernels: the Gemmas' sliding windows and soft-capping, Qwen3's and
Gemma 3's QK norm, Phi-3's partial rotary. The mixture-of-experts families (Qwen3-MoE, Mixtral)
run their experts through torch's grouped GEMM on CUDA; the test checks it was the path taken."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.gpu import GPU_MARKS, cupy_llm

pytest.importorskip("cupy")
pytestmark = GPU_MARKS

from engine import SamplingParams  # noqa: E402
from engine.testing.tiny_models import FAMILY_BUILDERS  # noqa: E402
from tests.gpu.test_engine_gpu import (  # noqa: E402
    LOGPROB_TOL,
    MAX_TOKENS,
    TOP,
    Greedy,
    assert_greedy_close,
    greedy_of,
    hf_greedy,
    shared_prefix_prompts,
)

D64 = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
"""head_dim 64 (256 / 4), GQA 2."""


def _phi3_rope(head_dim: int) -> dict[str, Any]:
    half = head_dim // 4  # partial_rotary_factor 0.5: rotary dims / 2
    return {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + 0.25 * i for i in range(half)],
        "long_factor": [2.0 + 1.5 * i for i in range(half)],
        "original_max_position_embeddings": 1024,
    }  # fmt: skip


OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3": {**D64, "head_dim": 64},
    "qwen3_moe": {**D64, "head_dim": 64},
    "mixtral": D64,
    "phi3": {**D64, "rope_parameters": _phi3_rope(64)},
    "gemma2": {**D64, "head_dim": 64},
    "gemma3": {**D64, "head_dim": 64},
}
MOE = {"qwen3_moe", "mixtral"}


@dataclass
class Family:
    name: str
    path: Path
    prompts: list[list[int]]
    ref: list[Greedy]
    """transformers' greedy run on the GPU, float32, eager attention (its soft-capping and
    sliding windows without SDPA's masks)."""


@pytest.fixture(scope="module", params=sorted(FAMILY_BUILDERS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name = request.param
    path = Path(FAMILY_BUILDERS[name](tmp_path_factory.mktemp(name), **OVERRIDES[name]))  # type: ignore[call-arg]
    from transformers import AutoConfig

    prompts = shared_prefix_prompts(AutoConfig.from_pretrained(str(path)).vocab_size)
    return Family(name, path, prompts, hf_greedy(path, prompts, attn_implementation="eager"))


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_family_cupy_matches_transformers_fp32(
    cuda_device: torch.device, family: Family, chunked: bool
) -> None:
    llm = cupy_llm(
        family.path, num_device_blocks=1024, max_num_batched_tokens=128 if chunked else 2048
    )
    assert llm.engine.core.backend.name == "cupy"
    moe = [m for m in llm.engine.core.model.modules() if hasattr(m, "grouped")]
    if family.name in MOE:
        assert moe and all(m.grouped for m in moe), "the experts should take torch._grouped_mm"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    ours = greedy_of(llm.generate(family.prompts, params))
    eng = llm.engine
    eng.core.kv.check_integrity()
    assert eng.core.kv.num_free_blocks == eng.core.kv.num_blocks
    eng.close()
    assert_greedy_close(ours, family.ref, LOGPROB_TOL["float32"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_matches_the_expert_loop(
    cuda_device: torch.device, dtype: torch.dtype
) -> None:
    """The experts' grouped GEMM on CUDA against one GEMM per expert (the same module with the
    grouped path off), rows sorted by expert with some experts idle: within the dtype's rounding
    of a float32 reference, no worse than the loop."""
    from engine.worker.models.layers.moe import Experts, MoESpec

    torch.manual_seed(0)
    spec = MoESpec(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2, renormalize=True)
    experts = Experts(spec, dtype).to(cuda_device)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    assert experts.grouped
    counts = torch.tensor([5, 0, 17, 1, 0, 40, 3, 9], device=cuda_device)
    x = torch.randn(int(counts.sum()), 256, device=cuda_device, dtype=dtype)
    with torch.inference_mode():
        grouped = experts(x, counts).float()
        experts.grouped = False
        loop = experts(x, counts).float()
        ref = Experts(spec, torch.float32).to(cuda_device)
        ref.gate_up_proj.copy_(experts.gate_up_proj.float())
        ref.down_proj.copy_(experts.down_proj.float())
        ref.grouped = False
        want = ref(x.float(), counts)
    scale = want.abs().max().item()
    err_grouped = (grouped - want).abs().max().item() / scale
    err_loop = (loop - want).abs().max().item() / scale
    print(f"{dtype}: relative max error grouped {err_grouped:.2e}, loop {err_loop:.2e}")
    if dtype == torch.bfloat16:
        assert err_grouped <= 2e-2 and err_grouped <= 2 * err_loop + 1e-6
    else:
        assert err_grouped <= 1e-5  # the loop is the reference itself here
