"""The 'auto' dtype: bfloat16 where the hardware computes in it, float32 elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.worker import cpu_features
from engine.worker.cpu_features import has_bf16_units, resolve_dtype


@pytest.mark.parametrize(
    ("flags", "cpu_dtype"),
    [
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # AMD Zen 4
        ({"avx2", "avx512f", "amx_tile", "amx_bf16"}, "bfloat16"),  # Intel Sapphire Rapids
        ({"avx2", "avx512f", "avx512bw"}, "float32"),  # AVX-512 without bf16: emulated, slower
        (set(), "float32"),  # unknown CPU
    ],
)
def test_auto_dtype(monkeypatch: pytest.MonkeyPatch, flags: set[str], cpu_dtype: str) -> None:
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    assert resolve_dtype("auto", "cpu") == cpu_dtype
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    for explicit in ("float32", "float16", "bfloat16"):
        assert resolve_dtype(explicit, "cpu") == explicit


def test_engine_resolves_auto_once(tiny_llama_path: Path) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_llama_path), dtype="auto", device="cpu", num_device_blocks=8)
    want = "bfloat16" if has_bf16_units() else "float32"
    core = llm.engine.core
    assert core.config.model.dtype == want
    assert core.model_info.dtype == want
    assert core.dtype == getattr(torch, want)
    out = llm.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
