"""The CUDA kernels, run on the CPU through the real loaders, against float64 references.

No GPU needed: tests/cuda_emu/host_shim.h runs every CUDA thread as a std::thread (see there for
what this does and does not prove). Needs g++ (see conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from cuda import block_copy, paged_attention, reshape_and_cache
from tests.cuda_emu.emulator import Emulator
from tests.support import kernel_reference as kref

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _names() -> list[str]:
    names = reshape_and_cache.instantiations() + block_copy.instantiations()
    return names + kref.attention_kernel_names(kref.ATTN_CONFIGS)


@pytest.fixture(scope="module")
def emulator() -> Emulator:
    return Emulator(_names())


def test_reshape_and_cache_skips_padding_and_follows_strides(emu: Emulator) -> None:
    for dtype, (hq, hkv, d) in [(BF16, (4, 2, 64)), (F32, (3, 1, 96)), (F16, (2, 2, 128))]:
        case = kref.make_case([3, 0, 20], [2, 5, 1], hq, hkv, d, 16, dtype, num_padding_tokens=2)
        # k / v as views into one fused qkv tensor, the way the model produces them
        t = case.q.shape[0]
        qkv = torch.cat(
            [case.q.reshape(t, -1), case.k.reshape(t, -1), case.v.reshape(t, -1)], dim=1
        )
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        expected = kref.write_reference(case)
        cache = case.kv_cache.clone()
        reshape_and_cache.reshape_and_cache(k, v, cache, case.slot_mapping)
        assert torch.equal(cache.isnan(), expected.isnan())
        assert torch.equal(cache.nan_to_num(), expected.nan_to_num())
    assert {name for name, _, _ in emu.launches} <= set(reshape_and_cache.instantiations())


@pytest.mark.parametrize("cfg", kref.ATTN_CONFIGS, ids=kref.config_id)
def test_decode_matches_reference(emu: Emulator, cfg: kref.AttnConfig) -> None:
    dtype, d, bs, hq, hkv = cfg
    case = kref.make_case([0, 16, 70, 31], [1, 1, 1, 1], hq, hkv, d, bs, dtype, seed=1)
    cache = kref.write_reference(case)
    scale = 1 / math.sqrt(d)
    out = kref.run_decode(case, cache, scale)
    assert [n for n, _, _ in emu.launches] == [
        paged_attention.decode_kernel_name(dtype, d, bs, paged_attention.heads_per_cta(hq // hkv))
    ]
    kref.assert_matches_reference(out, case, cache, scale)


@pytest.mark.parametrize("cfg", kref.ATTN_CONFIGS[:3], ids=kref.config_id)
def test_split_k_decode_matches_reference(emu: Emulator, cfg: kref.AttnConfig) -> None:
    dtype, d, bs, hq, hkv = cfg
    # 1100 tokens: 3 partitions of 512; 4 tokens: one partition, its other CTAs exit at once.
    case = kref.make_case([1099, 3, 600], [1, 1, 1], hq, hkv, d, bs, dtype, seed=2)
    cache = kref.write_reference(case)
    scale = 0.7 / math.sqrt(d)
    out = kref.run_decode(case, cache, scale, split=True)
    names = [n for n, _, _ in emu.launches]
    assert names[1] == paged_attention.reduce_kernel_name(dtype, d)
    assert emu.launches[0][1][2] == 3  # partitions
    kref.assert_matches_reference(out, case, cache, scale)


def test_split_k_heuristic(emu: Emulator) -> None:
    """Few CTAs and a long context split; many CTAs or short contexts do not."""
    assert paged_attention.use_split_k(32, 32768, 132)
    assert not paged_attention.use_split_k(512, 4096, 132)
    assert not paged_attention.use_split_k(8, 1024, 132)
    case = kref.make_case([1500], [1], 2, 2, 64, 16, F32, seed=3)
    cache = kref.write_reference(case)
    out = torch.empty_like(case.q)
    paged_attention.paged_decode_attention(
        out, case.q, cache, case.block_tables, case.seq_lens, 0.125, case.max_seq_len
    )
    assert len(emu.launches) == 2  # split-K kernel + reduction, chosen automatically
    ref = kref.attention_reference(case, cache, 0.125)
    assert (out.double() - ref).abs().max().item() < kref.tolerance(F32)


@pytest.mark.parametrize("cfg", kref.ATTN_CONFIGS, ids=kref.config_id)
def test_prefill_matches_reference(emu: Emulator, cfg: kref.AttnConfig) -> None:
    dtype, d, bs, hq, hkv = cfg
    # fresh prompt, chunk over a cached prefix, a decode token, a chunk crossing tile edges
    case = kref.make_case(
        [0, 21, 40, 3], [19, 12, 1, 40], hq, hkv, d, bs, dtype, num_padding_tokens=3, seed=4
    )
    cache = kref.write_reference(case)
    scale = 1 / math.sqrt(d)
    out = kref.run_prefill(case, cache, scale)
    kref.assert_matches_reference(out, case, cache, scale)
    n = case.num_queries
    assert out[n:].isnan().all()  # padding tokens untouched


def test_copy_blocks_all_layers(emu: Emulator) -> None:
    for dtype, shape in [(BF16, (3, 2, 10, 16, 2, 64)), (F32, (2, 2, 6, 32, 1, 96))]:
        cache = torch.randn(shape).to(dtype)
        src = torch.tensor([0, 4, 5], dtype=torch.int64)
        dst = torch.tensor([2, 1, 3], dtype=torch.int64)
        expected = cache.clone()
        expected[:, :, dst] = expected[:, :, src]
        block_copy.copy_blocks(cache, src, dst)
        assert torch.equal(cache, expected)


def test_gather_scatter_round_trip(emu: Emulator) -> None:
    cache = torch.randn(3, 2, 12, 16, 2, 64).to(F16)
    ids = torch.tensor([7, 2, 9, 0], dtype=torch.int64)
    staging = torch.empty(3, 2, 4, 16, 2, 64, dtype=F16)
    block_copy.gather_blocks(cache, ids, staging)
    assert torch.equal(staging, cache[:, :, ids])
    new = torch.randn_like(staging.float()).to(F16)
    expected = cache.clone()
    expected[:, :, ids] = new
    block_copy.scatter_blocks(new, cache, ids)
    assert torch.equal(cache, expected)


# (window, soft cap): a window inside one block, one spanning blocks, one longer than some
# contexts; a soft cap alone and with a window.
OPTIONS = [(1, None), (13, None), (40, None), (None, 0.7), (24, 0.5)]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("cfg", kref.ATTN_CONFIGS[:3], ids=kref.config_id)
def test_decode_window_and_soft_cap(
    emu: Emulator,
    cfg: kref.AttnConfig,
    options: tuple[int | None, float | None],
) -> None:
    """Blocks wholly before each window hold NaN (released): the kernel must not read them."""
    window, soft_cap = options
    dtype, d, bs, hq, hkv = cfg
    context_lens = [0, 16, 70, 31]
    case = kref.make_case(context_lens, [1] * 4, hq, hkv, d, bs, dtype, seed=5, window=window)
    cache = kref.write_reference(case)
    scale = 1.5 / math.sqrt(d)
    for split in (False, True):
        emu.launches.clear()
        out = kref.run_decode(case, cache, scale, split=split, window=window, soft_cap=soft_cap)
        kref.assert_matches_reference(
            out, case, cache, scale, window=window, soft_cap=soft_cap, context=split
        )


@pytest.mark.parametrize("cfg", kref.ATTN_CONFIGS[:3], ids=kref.config_id)
def test_split_k_decode_window_skips_partitions(emu: Emulator, cfg: kref.AttnConfig) -> None:
    """A 1,100-token context with a 600-token window: the grid spans the window (2 partitions,
    not 3), and the reduction combines only the partitions each sequence used."""
    dtype, d, bs, hq, hkv = cfg
    case = kref.make_case([1099, 3, 600], [1, 1, 1], hq, hkv, d, bs, dtype, seed=6, window=600)
    cache = kref.write_reference(case)
    scale = 0.7 / math.sqrt(d)
    out = kref.run_decode(case, cache, scale, split=True, window=600, soft_cap=2.0)
    assert emu.launches[0][1][2] == 2  # partitions: ceil((600 + bs - 1) / 512)
    kref.assert_matches_reference(out, case, cache, scale, window=600, soft_cap=2.0)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("cfg", kref.ATTN_CONFIGS[:4], ids=kref.config_id)
def test_prefill_window_and_soft_cap(
    emu: Emulator,
    cfg: kref.AttnConfig,
    options: tuple[int | None, float | None],
) -> None:
    window, soft_cap = options
    dtype, d, bs, hq, hkv = cfg
    # fresh prompt, chunk over a long cached prefix (released blocks before it), a decode
    # token, a chunk crossing tile edges
    case = kref.make_case(
        [0, 75, 40, 3],
        [19, 12, 1, 40],
        hq,
        hkv,
        d,
        bs,
        dtype,
        num_padding_tokens=3,
        seed=7,
        window=window,
    )
    cache = kref.write_reference(case)
    scale = 1.5 / math.sqrt(d)
    out = kref.run_prefill(case, cache, scale, window=window, soft_cap=soft_cap)
    kref.assert_matches_reference(out, case, cache, scale, window=window, soft_cap=soft_cap)
    n = case.num_queries
    assert out[n:].isnan().all()


def test_bad_options_are_refused(emu: Emulator) -> None:
    case = kref.make_case([5], [1], 2, 2, 64, 16, F32)
    cache = kref.write_reference(case)
    with pytest.raises(ValueError, match="sliding_window"):
        kref.run_decode(case, cache, 0.1, window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        kref.run_prefill(case, cache, 0.1, soft_cap=-1.0)
    assert emu.launches == []
