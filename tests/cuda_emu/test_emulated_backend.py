"""CupyAttentionBackend with its kernels emulated on the CPU, against the torch reference backend:
single layers (decode-only, mixed, padded batches) and the engine's greedy tokens end to end."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.testing.tiny_models import build_tiny_llama, build_tiny_mistral
from engine.worker.attention.cupy_backend import CupyAttentionBackend
from engine.worker.attention.torch_ref import TorchAttentionBackend
from tests.cuda_emu.emulator import Emulator
from tests.cuda_emu.test_emulated_kernels import _names
from tests.support.attention import make_attention_metadata
from tests.support.kernel_reference import make_case, tolerance

# head_dim 64 (hidden 256, 4 heads / 2 KV heads) so the kernels apply; float32 and block 16 are
# covered by ATTN_CONFIGS' (F32, 64, 16, 2, 2)-style instantiations plus the ones added here.
EXTRA_NAMES = [
    "deja::paged_decode_kernel<float, float, 64, 16, 2>",
    "deja::paged_prefill_kernel<float, float, 64, 16>",
    "deja::paged_decode_kernel<deja::bf16, deja::bf16, 64, 16, 2>",
    "deja::paged_decode_reduce_kernel<deja::bf16, 64>",
    "deja::paged_prefill_kernel<deja::bf16, deja::bf16, 64, 16>",
    "deja::paged_decode_kernel<float, deja::fp8e4m3, 64, 16, 2>",
    "deja::paged_prefill_kernel<float, deja::fp8e4m3, 64, 16>",
]


@pytest.fixture(scope="module")
def emulator() -> Emulator:
    return Emulator(_names() + EXTRA_NAMES)


@pytest.fixture
def backend(emulator: Emulator, monkeypatch: pytest.MonkeyPatch) -> CupyAttentionBackend:
    emulator.install(monkeypatch)
    emulator.launches.clear()
    b = object.__new__(CupyAttentionBackend)  # the constructor insists on CUDA
    b._setup(torch.device("cpu"), fallback=True)
    return b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "context_lens,query_lens,padding",
    [
        ([5, 0, 40, 17], [1, 1, 1, 1], 0),  # decode-only
        ([5, 0, 40, 17], [1, 9, 1, 20], 0),  # mixed prefill + decode
        ([0, 33], [16, 1], 3),  # padding tokens after the last sequence
    ],
)
def test_forward_matches_torch_backend(
    backend: CupyAttentionBackend,
    emulator: Emulator,
    dtype: torch.dtype,
    context_lens: list[int],
    query_lens: list[int],
    padding: int,
) -> None:
    case = make_case(context_lens, query_lens, 4, 2, 64, 16, dtype, num_padding_tokens=padding)
    cache = case.kv_cache.nan_to_num()  # the torch reference reads whole padded sequences
    tables = case.block_tables.tolist()
    meta, _ = make_attention_metadata(context_lens, query_lens, tables, 16, padding)
    scale = 1 / math.sqrt(64)
    ours_cache, ref_cache = cache.clone(), cache.clone()
    ours = backend.forward(case.q, case.k, case.v, ours_cache, meta, scale)
    ref = TorchAttentionBackend().forward(case.q, case.k, case.v, ref_cache, meta, scale)
    assert torch.equal(ours_cache, ref_cache)
    err = (ours.double() - ref.double()).abs().max().item()
    assert err < 2 * tolerance(dtype), err
    decode = max(query_lens) == 1
    kernels = [name.split("<")[0] for name, _, _ in emulator.launches]
    attention = "deja::paged_decode_kernel" if decode else "deja::paged_prefill_kernel"
    assert kernels[:2] == ["deja::reshape_and_cache_kernel", attention]


@pytest.mark.parametrize(
    "context_lens,query_lens", [([5, 0, 40, 17], [1, 1, 1, 1]), ([5, 0, 40, 17], [1, 9, 1, 20])]
)
def test_fp8_cache_matches_torch_backend(
    backend: CupyAttentionBackend,
    emulator: Emulator,
    context_lens: list[int],
    query_lens: list[int],
) -> None:
    from engine.worker.attention.kv_quant import FP8_DTYPE, KVScales, quantize_fp8

    case = make_case(context_lens, query_lens, 4, 2, 64, 16, torch.float32)
    meta, _ = make_attention_metadata(context_lens, query_lens, case.block_tables.tolist(), 16)
    scales = KVScales((1.0, 2.0**-4), (1.0, 2.0**-6))
    full = torch.empty((2, *case.kv_cache.shape), dtype=FP8_DTYPE)  # two layers
    full[1, 0] = quantize_fp8(case.kv_cache[0].nan_to_num(), scales.k[1])
    full[1, 1] = quantize_fp8(case.kv_cache[1].nan_to_num(), scales.v[1])
    ref_full = full.clone()
    ref_backend = TorchAttentionBackend()
    backend.bind_kv_cache(full, scales)
    ref_backend.bind_kv_cache(ref_full, scales)
    scale = 1 / math.sqrt(64)
    ours = backend.forward(case.q, case.k, case.v, full[1], meta, scale)
    ref = ref_backend.forward(case.q, case.k, case.v, ref_full[1], meta, scale)
    assert torch.equal(full.view(torch.uint8), ref_full.view(torch.uint8))  # same quantization
    err = (ours.double() - ref.double()).abs().max().item()
    assert err < 2 * tolerance(torch.float32), err
    kernels = [name for name, _, _ in emulator.launches]
    assert kernels[0] == "deja::reshape_and_cache_fp8_kernel<float>"
    assert "deja::fp8e4m3" in kernels[1]


DECODE_AND_MIXED = pytest.mark.parametrize(
    "context_lens,query_lens",
    [([5, 0, 70, 37], [1, 1, 1, 1]), ([5, 0, 70, 37], [1, 9, 1, 20])],
    ids=["decode", "mixed"],
)
"""Four sequences over the same contexts: decode only, and decode mixed with prefill chunks."""


@pytest.mark.parametrize("options", [(24, None), (None, 1.0), (40, 0.8)], ids=str)
@DECODE_AND_MIXED
def test_window_and_soft_cap_match_torch_backend(
    backend: CupyAttentionBackend,
    context_lens: list[int],
    query_lens: list[int],
    options: tuple[int | None, float | None],
) -> None:
    """Blocks wholly before the window point at one placeholder block (as the KV manager's
    released entries do), which holds NaN for the kernels: they must not read it."""
    window, soft_cap = options
    case = make_case(context_lens, query_lens, 4, 2, 64, 16, torch.float32, seed=9, window=window)
    tables = case.block_tables.tolist()
    cache = case.kv_cache.nan_to_num()
    placeholder = cache.shape[1]
    cache = torch.cat([cache, torch.full_like(cache[:, :1], float("nan"))], dim=1)
    if window is not None:
        for row, ctx in zip(tables, context_lens, strict=True):
            for i in range(max(0, ctx - window + 1) // 16):
                row[i] = placeholder
    meta, _ = make_attention_metadata(context_lens, query_lens, tables, 16)
    args = (case.q, case.k, case.v)
    ours = backend.forward(
        *args, cache.clone(), meta, 0.2, sliding_window=window, logits_soft_cap=soft_cap
    )
    ref_cache = cache.nan_to_num()  # the torch reference masks what it gathers; NaN would leak
    ref = TorchAttentionBackend().forward(
        *args, ref_cache, meta, 0.2, sliding_window=window, logits_soft_cap=soft_cap
    )
    err = (ours.double() - ref.double()).abs().max().item()
    assert err < 2 * tolerance(torch.float32), err


@pytest.mark.parametrize("options", [(24, None), (40, 0.8)], ids=str)
@DECODE_AND_MIXED
def test_window_and_soft_cap_on_fp8_cache_match_torch_backend(
    backend: CupyAttentionBackend,
    emulator: Emulator,
    context_lens: list[int],
    query_lens: list[int],
    options: tuple[int | None, float | None],
) -> None:
    """Window, soft cap and an fp8 cache together: the K scale (2^-4) is folded into the
    kernels' softmax scale, so the soft cap must still see q . k_true * scale (a cap applied to
    q . k_code * scale would be 16x off). Released blocks point at a placeholder holding fp8 NaN
    codes (0x7f) for the kernels, zeros for the reference, which gathers and masks them."""
    from engine.worker.attention.kv_quant import FP8_DTYPE, KVScales, quantize_fp8

    window, soft_cap = options
    case = make_case(context_lens, query_lens, 4, 2, 64, 16, torch.float32, seed=9, window=window)
    tables = case.block_tables.tolist()
    placeholder = case.kv_cache.shape[1]
    if window is not None:
        for row, ctx in zip(tables, context_lens, strict=True):
            for i in range(max(0, ctx - window + 1) // 16):
                row[i] = placeholder
    meta, _ = make_attention_metadata(context_lens, query_lens, tables, 16)
    scales = KVScales((1.0, 2.0**-4), (1.0, 2.0**-6))
    layer_shape = (2, placeholder + 1, *case.kv_cache.shape[2:])
    full = torch.zeros((2, *layer_shape), dtype=FP8_DTYPE)  # two layers; attend with layer 1
    full[1, 0, :placeholder] = quantize_fp8(case.kv_cache[0].nan_to_num(), scales.k[1])
    full[1, 1, :placeholder] = quantize_fp8(case.kv_cache[1].nan_to_num(), scales.v[1])
    ref_full = full.clone()
    full.view(torch.uint8)[1, :, placeholder] = 0x7F  # e4m3 NaN
    ref_backend = TorchAttentionBackend()
    backend.bind_kv_cache(full, scales)
    ref_backend.bind_kv_cache(ref_full, scales)
    args = (case.q, case.k, case.v)
    ours = backend.forward(
        *args, full[1], meta, 0.2, sliding_window=window, logits_soft_cap=soft_cap
    )
    ref = ref_backend.forward(
        *args, ref_full[1], meta, 0.2, sliding_window=window, logits_soft_cap=soft_cap
    )
    assert torch.equal(
        full[:, :, :placeholder].view(torch.uint8), ref_full[:, :, :placeholder].view(torch.uint8)
    )
    err = (ours.double() - ref.double()).abs().max().item()
    assert err < 2 * tolerance(torch.float32), err
    kernels = [name for name, _, _ in emulator.launches]
    assert kernels[0] == "deja::reshape_and_cache_fp8_kernel<float>"
    assert "deja::fp8e4m3" in kernels[1]


def test_unsupported_head_dim_falls_back_to_torch(
    backend: CupyAttentionBackend, emulator: Emulator
) -> None:
    case = make_case([3, 10], [4, 1], 4, 2, 16, 16, torch.float32)
    tables = case.block_tables.tolist()
    meta, _ = make_attention_metadata([3, 10], [4, 1], tables, 16)
    cache = case.kv_cache.nan_to_num()
    ours = backend.forward(case.q, case.k, case.v, cache.clone(), meta, 0.25)
    ref = TorchAttentionBackend().forward(case.q, case.k, case.v, cache.clone(), meta, 0.25)
    assert torch.equal(ours, ref)
    assert emulator.launches == []
    strict = object.__new__(CupyAttentionBackend)
    strict._setup(torch.device("cpu"), fallback=False)
    with pytest.raises(ValueError, match="head_dim"):
        strict.forward(case.q, case.k, case.v, cache.clone(), meta, 0.25)


def test_copy_blocks(backend: CupyAttentionBackend) -> None:
    cache = torch.randn(2, 2, 8, 16, 2, 64)
    expected = cache.clone()
    src, dst = torch.tensor([1, 6]), torch.tensor([3, 0])
    TorchAttentionBackend().copy_blocks(expected, src, dst)
    backend.copy_blocks(cache, src, dst)
    assert torch.equal(cache, expected)


def _stem_prompts(seed: int, stem_len: int, shapes: list[tuple[int, int]]) -> list[list[int]]:
    """Random prompts, each the first `n` tokens of one shared stem and `k` of its own, for each
    `(n, k)` of `shapes`."""
    rng = random.Random(seed)
    stem = [rng.randrange(10, 500) for _ in range(stem_len)]
    return [stem[:n] + [rng.randrange(10, 500) for _ in range(k)] for n, k in shapes]


def _torch_and_emulated(
    path: Path,
    prompts: list[list[int]],
    max_tokens: int,
    budget: int,
    emulator: Emulator,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[list[int]], list[list[int]], set[str], Any]:
    """(the torch backend's tokens, the emulated kernels' tokens, the kernels launched, the
    emulated engine's LLM): the same float32 CPU engine (128 blocks, `budget` tokens a step)
    generating `max_tokens` greedy tokens twice, the second with the cupy backend's kernels
    emulated on the CPU (its factory patched in)."""
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    kwargs: dict[str, Any] = dict(
        device="cpu", dtype="float32", num_device_blocks=128, max_num_batched_tokens=budget
    )
    torch_llm = LLM(model=str(path), attention_backend="torch", **kwargs)
    expected = [o.token_ids for o in torch_llm.generate(prompts, params)]

    emulator.install(monkeypatch)
    import engine.worker.worker

    def emulated_backend(name: str, device: torch.device) -> CupyAttentionBackend:
        b = object.__new__(CupyAttentionBackend)
        b._setup(device, fallback=False)
        return b

    monkeypatch.setattr(engine.worker.worker, "get_attention_backend", emulated_backend)
    emulator.launches.clear()
    cupy_llm = LLM(model=str(path), attention_backend="torch", **kwargs)  # patched factory
    got = [o.token_ids for o in cupy_llm.generate(prompts, params)]
    used = {name.split("<")[0] for name, _, _ in emulator.launches}
    return expected, got, used, cupy_llm


@pytest.fixture(scope="module")
def llama64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("llama-d64"), hidden_size=256)


def test_engine_greedy_tokens_match_torch_backend(
    llama64: Path, emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prefill (budget 48), prefix caching and decode, 2 layers, float32."""
    prompts = _stem_prompts(0, 90, [(0, 5), (90, 3), (40, 30), (0, 70), (17, 1)])
    expected, got, used, _ = _torch_and_emulated(llama64, prompts, 12, 48, emulator, monkeypatch)
    assert {"deja::paged_decode_kernel", "deja::paged_prefill_kernel"} <= used
    assert got == expected


@pytest.fixture(scope="module")
def mistral64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mistral(
        tmp_path_factory.mktemp("mistral-d64"), sliding_window=32, hidden_size=256
    )


def test_engine_sliding_window_tokens_match_torch_backend(
    mistral64: Path, emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Mistral with window 32 (every layer: the KV manager releases blocks): chunked prefill
    (budget 40), prefix caching and decode past the window, kernels against the torch backend."""
    prompts = _stem_prompts(1, 100, [(0, 5), (100, 3), (60, 30), (0, 90)])
    expected, got, used, cupy_llm = _torch_and_emulated(
        mistral64, prompts, 20, 40, emulator, monkeypatch
    )
    assert cupy_llm.engine.core.kv.sliding_window == 32
    assert {"deja::paged_decode_kernel", "deja::paged_prefill_kernel"} <= used
    assert got == expected
