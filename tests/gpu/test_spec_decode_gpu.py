"""Speculative decoding on a GPU with the cupy backend: greedy float32 tokens with proposals
verified (ngram, draft model) equal transformers', with decode CUDA graphs on (steps without
proposals replay them; verifying steps run eager)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.gpu import GPU_MARKS, cupy_llm

pytest.importorskip("cupy")
pytestmark = GPU_MARKS

from engine import SamplingParams  # noqa: E402
from engine.testing.tiny_models import build_tiny_llama  # noqa: E402
from tests.engine.test_spec_decode import repeating_prompts  # noqa: E402
from tests.support.reference import hf_greedy  # noqa: E402


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verification_under_cupy_matches_transformers(tmp_path: Path, method: str) -> None:
    path = build_tiny_llama(tmp_path / "m", hidden_size=256, num_attention_heads=4)
    # prompts on which this model's greedy argmax is never EOS: transformers' reference masks EOS
    # (min_new_tokens), ignore_eos samples it
    prompts = repeating_prompts(512, 8, seed=4)
    expected = hf_greedy(path, prompts, 24)
    spec = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        spec["model"] = str(path)
    llm = cupy_llm(path, block_size=16, num_device_blocks=512, speculative_config=spec)
    assert llm.engine.core.backend.name == "cupy"
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.get_stats().spec
    assert stats is not None and stats.num_accepted_tokens > 0
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
