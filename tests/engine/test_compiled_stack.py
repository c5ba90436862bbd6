"""The compiled decoder stack (models/compiled.py, cpu_decoder.cpp): the steps it runs give the
same bits as the modules' forward, hidden states and KV cache alike, and the models or steps it
does not take go to the modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.testing.tiny_gguf import write_gguf
from engine.testing.tiny_models import build_tiny_llama
from engine.worker.attention import cpu_paged
from engine.worker.attention.cpu_kernel import load_kernel
from engine.worker.model_loader import model_fingerprint
from engine.worker.models.compiled import CompiledStack
from engine.worker.models.layers import quantized
from engine.worker.models.layers.quantized import (
    EVERY_ROW,
    GEMV_ROWS,
    INT8_ROWS_BEFORE_AMX,
    INT8_ROWS_BEFORE_SLABS,
    GroupedLinear,
    Int4Linear,
    Q8Linear,
)
from tests.engine.test_gguf import LLAMA_TYPES
from tests.engine.test_parity import shared_prefix_prompts

pytestmark = pytest.mark.skipif(load_kernel().ops is None, reason="no C++ CPU kernels")

MIXED = {name: kind for name, kind in LLAMA_TYPES.items() if not name.startswith("layers.")}
"""4-bit attention, 8-bit gate / up, 4-bit down: both kinds of linear in every layer."""


@pytest.fixture(scope="module")
def llama_file(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_llama_path, tmp_path_factory.mktemp("gguf") / "llama.gguf", MIXED)


@pytest.fixture(scope="module")
def qwen2_file(tiny_qwen2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """q / k / v biases through the stack; a tied Q8_0 head."""
    out = tmp_path_factory.mktemp("gguf") / "qwen2.gguf"
    return write_gguf(tiny_qwen2_path, out, {"proj": "Q4_1", "embed_tokens": "Q8_0"})


def _model(llm: LLM) -> Any:
    return llm.engine.core.executor.driver.model


class _Checked:
    """Wraps a model's forward: each step runs as the model runs it (the stack where it takes
    the step), then again through the modules on a copy of the cache from before the step; the
    hidden states and the caches after must be equal, bit for bit."""

    def __init__(self, model: Any) -> None:
        self.model, self.stack = model, model.compiled
        self.forward = model.forward
        self.compiled_steps = self.module_steps = self.widest = 0
        real_run = self.stack.run

        def counted(*args: Any) -> torch.Tensor:
            self.compiled_steps += 1
            self.widest = max(self.widest, args[0].shape[0])  # (h: [T, hidden])
            out: torch.Tensor = real_run(*args)
            return out

        self.stack.run = counted

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: Any
    ) -> torch.Tensor:
        before_steps, before = self.compiled_steps, kv_cache.clone()
        got = self.forward(input_ids, positions, kv_cache, meta)
        if self.compiled_steps == before_steps:
            self.module_steps += 1
            return got
        after = kv_cache.clone()
        kv_cache.copy_(before)
        self.model.compiled = None
        try:
            want = self.forward(input_ids, positions, kv_cache, meta)
        finally:
            self.model.compiled = self.stack
        assert torch.equal(got, want), f"hidden states differ at {input_ids.shape[0]} tokens"
        assert torch.equal(kv_cache, after), "the stack wrote another cache than the modules"
        return got


@pytest.mark.parametrize(
    ("dtype", "activations"),
    [("float32", "float"), ("bfloat16", "float"), ("float32", "int8"), ("bfloat16", "int8")],
)
@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_stack_gives_the_modules_bits(
    which: str,
    dtype: str,
    activations: str,
    llama_file: Path,
    qwen2_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode steps of many sequences at once and short chunks, with a cached prefix and
    chunked prefill: every step the stack runs equals the modules' step (int8 activations
    included: the same integer products either way, and the slab product past their bound,
    brought within 20 sequences' reach here)."""
    monkeypatch.setattr(quantized, "INT8_ROWS_BEFORE_SLABS", 12)
    file = llama_file if which == "llama" else qwen2_file
    llm = LLM(
        str(file),
        dtype=dtype,
        quantization="gguf",
        activations=activations,
        block_size=16,
        num_device_blocks=256,
        max_num_batched_tokens=40,
    )
    model = _model(llm)
    assert isinstance(model.compiled, CompiledStack)
    check = _Checked(model)
    model.forward = check
    # (20 sequences: decode steps past AMX's slab bound, and the int8 tiles' there)
    prompts = shared_prefix_prompts(512, 20, 128, seed=3)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
    assert check.compiled_steps >= 9  # every decode step
    assert check.module_steps >= 1  # the prefill chunks of 40 tokens
    slab_from = min(m.slab_from(model.dtype) for m in model.modules() if hasattr(m, "slab_from"))
    if slab_from:  # the stack's slab product ran (every bound here is under 20 rows)
        assert check.widest >= slab_from
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_chunks_through_the_stack_give_the_modules_bits(
    dtype: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Head dim 64, which the attention kernel's vector path takes: prefill chunks stay with the
    kernel (not SDPA), so the stack runs them too, with the same bits as the modules."""
    base = build_tiny_llama(
        tmp_path_factory.mktemp("d64"),
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    file = write_gguf(base, tmp_path_factory.mktemp("gguf") / "d64.gguf", MIXED)
    llm = LLM(
        str(file),
        dtype=dtype,
        quantization="gguf",
        block_size=16,
        num_device_blocks=256,
        max_num_batched_tokens=40,
    )
    model = _model(llm)
    assert isinstance(model.compiled, CompiledStack)
    cache = llm.engine.core.executor.driver.kv_cache
    assert cache is not None
    assert model.backend.sdpa_min_queries == cpu_paged.sdpa_min_queries(cache)
    check = _Checked(model)
    model.forward = check
    prompts = shared_prefix_prompts(256, 6, 64, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    if model.backend.sdpa_min_queries == cpu_paged.NEVER:
        assert check.module_steps == 0  # every step, chunks of 40 tokens included, in the stack
        assert check.widest == 40
    else:  # (a CPU where chunks go to SDPA: the modules take them)
        assert check.module_steps >= 1


def test_models_the_stack_does_not_take_keep_the_modules(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    """An expanded (16-bit) projection, or no quantization at all: no stack, and why."""
    file = write_gguf(
        tiny_llama_path, tmp_path / "half.gguf", {"layers.1.mlp.down_proj": "Q5_0", **MIXED}
    )
    model = _model(LLM(str(file), dtype="float32", quantization="gguf", num_device_blocks=64))
    assert model.compiled is None
    stack, reason = CompiledStack.build(model, load_kernel().ops)
    assert stack is None and reason == "layer 1: a projection not kept quantized"
    plain = _model(LLM(str(tiny_llama_path), dtype="float32", num_device_blocks=64))
    assert plain.compiled is None
    assert CompiledStack.build(plain, None)[1] == "the C++ CPU kernels are not loaded"


def test_int8_activations_need_weights_kept_quantized(tiny_llama_path: Path) -> None:
    with pytest.raises(ValueError, match=r"activations int8 .* keeps none"):
        LLM(str(tiny_llama_path), dtype="float32", activations="int8", num_device_blocks=64)


def test_int8_activations_take_the_integer_products(llama_file: Path) -> None:
    """--activations int8 reaches every kept linear: close to the float products, not equal."""
    model = _model(LLM(str(llama_file), dtype="float32", activations="int8", num_device_blocks=64))
    kept = [m for m in model.modules() if isinstance(m, GroupedLinear)]
    assert kept and all(m.int8_activations for m in kept)
    for linear in kept:
        x = torch.randn(3, linear.in_features)
        got = linear(x)
        linear.int8_activations = False
        want = linear(x)
        linear.int8_activations = True
        err = ((got - want).norm() / want.norm()).item()
        assert 0 < err < 0.05, err


def test_int8_activations_take_every_row_on_the_groups_where_tiled(llama_file: Path) -> None:
    """With AVX-512 VNNI (the kernels' tiled product), a 4- or 8-bit linear with int8
    activations multiplies a prefill's many rows on its groups too, close to the float product;
    elsewhere it expands its weight beyond GEMV_ROWS as before."""
    model = _model(LLM(str(llama_file), dtype="float32", activations="int8", num_device_blocks=64))
    ops: Any = load_kernel().ops
    tiled = ops.linear_i8_tile_rows() > 0
    kept = [m for m in model.modules() if isinstance(m, GroupedLinear)]
    assert {type(m) for m in kept} == {Int4Linear, Q8Linear}
    # the layer stack takes decode steps of any size then
    assert model.compiled.max_tokens == (EVERY_ROW if tiled else GEMV_ROWS)
    for linear in kept:
        assert linear.gemv_rows(torch.float32) == (EVERY_ROW if tiled else GEMV_ROWS)
        x = torch.randn(GEMV_ROWS + 37, linear.in_features)
        got = linear(x)
        if tiled and isinstance(linear, Int4Linear):
            assert torch.equal(got, ops.q4_linear_i8(x, linear.qs, linear.scale, linear.zero))
        elif tiled:
            assert torch.equal(got, ops.q8_linear_i8(x, linear.qs, linear.scale))
        linear.int8_activations = False
        want = linear(x)
        linear.int8_activations = True
        err = ((got - want).norm() / want.norm()).item()
        assert (0 < err < 0.05) if tiled else err == 0, err


def test_int8_tiles_leave_sixteen_input_scales_to_the_float_product() -> None:
    """An 8-bit weight with a scale every 16 inputs (Q6_K) takes the float product with int8
    activations, so it keeps the few-row bound; one scale a group takes the tiles where built."""
    ops: Any = load_kernel().ops
    tiled = ops.linear_i8_tile_rows() > 0
    rng = np.random.default_rng(0)
    q = rng.integers(-32, 32, (48, 96)).astype(np.int8)
    for width, want in ((96 // 16, GEMV_ROWS), (96 // 32, EVERY_ROW if tiled else GEMV_ROWS)):
        linear = Q8Linear(q, rng.random((48, width)).astype(np.float32), None, torch.float32)
        linear.int8_activations = True
        linear.use_kernel(ops)
        assert linear.gemv_rows(torch.float32) == want, width
        linear.int8_activations = False  # float activations: the few-row bound again
        assert linear.gemv_rows(torch.float32) == GEMV_ROWS


def test_bfloat16_rows_past_the_few_row_bound_take_the_slab_product_where_built(
    llama_file: Path,
) -> None:
    """On a CPU with bfloat16 dot products (the kernels' linear_bf16_rows: AMX tiles or
    vdpbf16ps), a kept linear multiplies bfloat16 rows past the few-row bound in slabs instead
    of expanding its weight: the same as the op, the expanded weight's product up to float32
    summation order, and every step's row count is the compiled stack's; with int8 activations
    the int8 tiles keep the rows up to INT8_ROWS_BEFORE_AMX (AMX) or INT8_ROWS_BEFORE_SLABS
    (vdpbf16ps). Elsewhere the weight is expanded."""
    ops: Any = load_kernel().ops
    slabs, amx = ops.linear_bf16_rows(), ops.linear_amx_rows()
    model = _model(LLM(str(llama_file), dtype="bfloat16", num_device_blocks=64))
    kept = [m for m in model.modules() if isinstance(m, GroupedLinear)]
    assert {type(m) for m in kept} == {Int4Linear, Q8Linear}
    for linear in kept:
        if slabs:
            assert linear.gemv_rows(torch.bfloat16) == slabs - 1
            assert linear.slab_from(torch.bfloat16) == slabs
            assert linear.step_rows(torch.bfloat16) == EVERY_ROW
        else:
            assert linear.slab_from(torch.bfloat16) == 0
        x = torch.randn(GEMV_ROWS + 37, linear.in_features).bfloat16()
        got = linear(x)
        if slabs and isinstance(linear, Int4Linear):
            assert torch.equal(got, ops.q4_linear_bf16(x, linear.qs, linear.scale, linear.zero))
        elif slabs:
            assert torch.equal(got, ops.q8_linear_bf16(x, linear.qs, linear.scale))
        want = x.float() @ linear._dense(torch.bfloat16).float().T
        assert ((got.float() - want).abs().max() / want.abs().max()).item() < 5e-3
        linear.int8_activations = True
        tiled = ops.linear_i8_tile_rows() > 0
        if tiled and slabs:  # int8 tiles, then the slab product
            bound = INT8_ROWS_BEFORE_AMX if amx else INT8_ROWS_BEFORE_SLABS
        else:
            bound = EVERY_ROW if tiled else linear._gemv_rows[torch.bfloat16]
        assert linear.gemv_rows(torch.bfloat16) == bound
        assert linear.slab_from(torch.bfloat16) == (bound + 1 if slabs and bound < EVERY_ROW else 0)
        linear.int8_activations = False


def test_int8_activations_get_their_own_fingerprint(
    llama_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KV written with int8 activations is not shared (disk, remote tiers) with float's, nor
    with KV from another int8 rounding."""
    int8 = model_fingerprint(llama_file, "auto", "int8")
    assert int8 != model_fingerprint(llama_file, "auto")
    assert model_fingerprint(llama_file, "auto", "float") == model_fingerprint(llama_file, "auto")
    monkeypatch.setattr("engine.worker.model_loader.INT8_ROUNDING", "symmetric-32")
    assert model_fingerprint(llama_file, "auto", "int8") != int8
