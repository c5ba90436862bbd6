"""cuda/quant_linear.cu (the products of weights kept 4- and 8-bit) emulated on the CPU: the
expansion against the C++ CPU kernel's bits, the few-row product against the dequantized weight
in float64, a GroupedLinear on the CUDA kernels, and a GGUF model's greedy tokens on them against
transformers' on the file's dequantized weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cuda import layers, quant_linear
from engine import LLM, SamplingParams
from engine.testing.tiny_gguf import quantized_blocks, write_gguf
from engine.worker.gguf_checkpoint import QuantizedRows
from engine.worker.models.layers.group_rows import unpack, unpack_q6_k, unpack_q8_0
from engine.worker.models.layers.quantized import GroupedLinear, Int4Linear, Q8Linear
from tests.cuda_emu.emulator import Emulator
from tests.engine.test_gguf import LLAMA_TYPES, QWEN2_TYPES
from tests.support.reference import hf_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K"]
"""Q4_0 / Q4_1 keep the file's fp16 pairs, Q4_K float32 scales and zeros, Q8_0 fp16 scales,
Q6_K float32 scales every 16 inputs."""


@pytest.fixture(scope="module")
def emulator() -> Emulator:
    return Emulator(layers.instantiations() + quant_linear.instantiations())


def _layer(kind: str, n: int, k: int, dtype: torch.dtype, bias: bool = False) -> GroupedLinear:
    from gguf import GGMLQuantizationType

    qtype = GGMLQuantizationType[kind]
    w = np.random.default_rng(n + k).standard_normal((n, k)).astype(np.float32)
    rows = QuantizedRows(qtype, quantized_blocks(w, qtype, np.random.default_rng(1)), (n, k))
    b = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype) if bias else None
    if kind == "Q8_0":
        return Q8Linear(*unpack_q8_0(rows), b, dtype)
    if kind == "Q6_K":
        return Q8Linear(*unpack_q6_k(rows), b, dtype)
    return Int4Linear(*unpack(rows), b, dtype)


def _expand(layer: GroupedLinear, dtype: torch.dtype, ops: object) -> torch.Tensor:
    if isinstance(layer, Int4Linear):
        return ops.q4_dequant(layer.qs, layer.scale, layer.zero, dtype)  # type: ignore[attr-defined]
    return ops.q8_dequant(layer.qs, layer.scale, dtype)  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_expansion_gives_the_cpu_kernels_bits(emu: Emulator, kind: str, dtype: torch.dtype) -> None:
    from engine.worker.attention.cpu_kernel import load_kernel

    cpu = load_kernel().ops
    if cpu is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    layer = _layer(kind, 24, 256, torch.float32)
    assert layer.scale.dtype == (torch.float32 if kind in ("Q4_K", "Q6_K") else torch.float16)
    ours = _expand(layer, dtype, quant_linear)
    want = _expand(layer, torch.float32, cpu).to(dtype)  # one rounding from float32, as ours
    assert ours.dtype == dtype and torch.equal(ours, want)
    name = "q8" if kind in ("Q8_0", "Q6_K") else "q4"
    assert [n for n, _, _ in emu.launches] == [
        quant_linear.kernel_name(name, "dequant", dtype, layer.scale.dtype)
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_few_row_product_matches_the_dequantized_weight(
    emu: Emulator, kind: str, dtype: torch.dtype
) -> None:
    """Every row count up to GEMV_ROWS, an output count that leaves a CTA's warps idle (37), a
    row stride wider than the row, more groups than a warp has lanes (2048 inputs: 64): float32
    sums of the dequantized weight's products."""
    layer = _layer(kind, 37, 2048, torch.float32)
    dense = layer._dense(torch.float32).double()
    g = torch.Generator().manual_seed(2)
    for rows in range(1, quant_linear.GEMV_ROWS + 1):
        x = torch.randn(rows, 2100, generator=g)[:, :2048].to(dtype)
        if isinstance(layer, Int4Linear):
            got = quant_linear.q4_linear(x, layer.qs, layer.scale, layer.zero)
        else:
            got = quant_linear.q8_linear(x, layer.qs, layer.scale)
        want = x.double() @ dense.T
        assert got.dtype == dtype and got.shape == (rows, 37)
        tol = 5e-5 if dtype == torch.float32 else 2 ** -(7 if dtype == torch.bfloat16 else 10)
        err = ((got.double() - want).abs() / want.abs().clamp(min=1.0)).max().item()
        assert err < tol, (rows, err)
    assert len(emu.launches) == quant_linear.GEMV_ROWS


def test_q6_k_with_float16_scales(emu: Emulator) -> None:
    """A 16-input scale kept in float16 (exact there): the same products as with float32."""
    layer = _layer("Q6_K", 8, 256, torch.float32)
    half = layer.scale.half()
    layer.scale = half.float()  # every scale a float16 value
    x = torch.randn(3, 256)
    want = quant_linear.q8_linear(x, layer.qs, layer.scale)
    assert torch.equal(quant_linear.q8_linear(x, layer.qs, half), want)
    assert torch.equal(
        quant_linear.q8_dequant(layer.qs, half, torch.float32),
        quant_linear.q8_dequant(layer.qs, layer.scale, torch.float32),
    )
    assert {n for n, _, _ in emu.launches} == {
        quant_linear.kernel_name("q8", op, torch.float32, t)
        for op in ("gemv", "dequant")
        for t in (torch.float16, torch.float32)
    }


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_grouped_linear_on_the_cuda_kernels(emu: Emulator, kind: str) -> None:
    """Up to GEMV_ROWS rows on the groups, more through the expansion and a dense product, the
    bias added; as the layer without kernels (torch's expansion)."""
    fast, plain = (
        _layer(kind, 40, 96, torch.float32, True),
        _layer(kind, 40, 96, torch.float32, True),
    )
    fast.use_kernel(quant_linear)
    assert fast.gemv_rows(torch.bfloat16) == quant_linear.GEMV_ROWS
    for m in (1, quant_linear.GEMV_ROWS, quant_linear.GEMV_ROWS + 1, 40):
        emu.launches.clear()
        x = torch.randn(m, 96)
        torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)
        op = "gemv" if m <= quant_linear.GEMV_ROWS else "dequant"
        assert [n.split("<")[0] for n, _, _ in emu.launches] == [
            f"deja::{'q8' if kind == 'Q8_0' else 'q4'}_{op}_kernel"
        ]


def test_loader_refuses_what_the_kernels_do_not_take() -> None:
    layer = _layer("Q4_1", 8, 64, torch.float32)
    assert isinstance(layer, Int4Linear)
    with pytest.raises(ValueError, match="up to 8 rows"):
        quant_linear.q4_linear(torch.randn(9, 64), layer.qs, layer.scale, layer.zero)
    with pytest.raises(ValueError, match=r"x must be \[rows, 64\]"):
        quant_linear.q4_linear(torch.randn(2, 32), layer.qs, layer.scale, layer.zero)
    with pytest.raises(ValueError, match="q4 qs must be 2-D uint8"):
        quant_linear.q4_linear(
            torch.randn(2, 64), layer.qs.view(torch.int8), layer.scale, layer.zero
        )
    with pytest.raises(ValueError, match="zero must be"):
        quant_linear.q4_dequant(layer.qs, layer.scale, layer.zero.float(), torch.float32)
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        quant_linear.q4_linear(torch.randn(2, 64), layer.qs, layer.scale, layer.zero)


def _on_the_cuda_kernels(emulator: Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, a model loaded on the CPU takes deja's CUDA kernels for its norms, RoPE,
    SiLU and kept linears (emulated), as the cupy backend hands them, instead of the CPU ones."""
    from engine.worker.models.base import CausalLM

    emulator.install(monkeypatch)
    emulator.launches.clear()
    monkeypatch.setattr(
        CausalLM,
        "use_cpu_layout",
        lambda self, kernels=None: self.use_kernels(layers, quant_linear),
    )


def _used(emulator: Emulator) -> set[str]:
    """The kernels launched, without their template arguments."""
    return {name.split("<")[0] for name, _, _ in emulator.launches}


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_gguf_model_on_the_cuda_kernels_matches_transformers(
    which: str,
    emulator: Emulator,
    monkeypatch: pytest.MonkeyPatch,
    tiny_llama_path: Path,
    tiny_qwen2_path: Path,
    tmp_path: Path,
) -> None:
    """Greedy float32 tokens of a GGUF file's model with its kept linears (Q4_0, Q4_1, Q8_0 and
    a tied Q8_0 head) and its norms, RoPE and SiLU on deja's CUDA kernels, as the cupy backend
    runs them, against transformers on the file's dequantized weights; prefill takes the
    expansion, decode the product on the groups."""
    src, types = (
        (tiny_llama_path, LLAMA_TYPES) if which == "llama" else (tiny_qwen2_path, QWEN2_TYPES)
    )
    file = write_gguf(src, tmp_path / f"{which}.gguf", types)
    prompts = [[5 + i for i in range(n)] for n in (3, 21)]
    want, _ = hf_reference(file.parent, prompts, 6, gguf_file=file.name)
    _on_the_cuda_kernels(emulator, monkeypatch)
    llm = LLM(str(file), dtype="float32", quantization="gguf", num_device_blocks=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert {"deja::q4_gemv_kernel", "deja::q4_dequant_kernel", "deja::q8_gemv_kernel"} <= _used(
        emulator
    )


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_load_time_quantized_model_on_the_cuda_kernels(
    kind: str, emulator: Emulator, monkeypatch: pytest.MonkeyPatch, tiny_qwen2_path: Path
) -> None:
    """`--quantization int4|int8` (float32 scales; int4 with zeros; q/k/v biases): greedy tokens
    with the kept linears on the CUDA kernels equal the same model's with torch's expansion."""
    from engine.worker.models.base import CausalLM

    prompts = [[5 + i for i in range(n)] for n in (3, 21)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(str(tiny_qwen2_path), dtype="float32", quantization=kind, num_device_blocks=32)
        kept = [m for m in llm.engine.core.executor.driver.model.modules()]
        assert sum(isinstance(m, GroupedLinear) for m in kept) == 8  # 2 x (qkv, o, gate_up, down)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    monkeypatch.setattr(CausalLM, "use_cpu_layout", lambda self, kernels=None: None)
    want = run()
    _on_the_cuda_kernels(emulator, monkeypatch)
    assert run() == want
    q = "q4" if kind == "int4" else "q8"
    assert {f"deja::{q}_gemv_kernel", f"deja::{q}_dequant_kernel"} <= _used(emulator)
