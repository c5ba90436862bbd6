"""The torch attention backend against a plain per-sequence reference, and the backend factory."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.worker.attention import TorchAttentionBackend, get_attention_backend
from engine.worker.attention.base import AttentionMetadata
from tests.support.attention import make_attention_metadata

torch.set_num_threads(2)

HEAD_DIM = 8


def _random_tables(
    rng: random.Random, seq_lens: list[int], block_size: int, spare: int = 3
) -> tuple[list[list[int]], int]:
    """Disjoint, shuffled block tables covering each sequence; returns (tables, num_blocks)."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at : at + n])
        at += n
    return tables, num_blocks


def random_step(
    key: str,
    context_lens: list[int],
    query_lens: list[int],
    padding: int,
    heads: tuple[int, int],
    block_size: int,
    head_dim: int,
) -> tuple[
    AttentionMetadata, list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """A random step seeded by `key`: (metadata, block tables, q, k, v, cache) in float32, the
    cache [2, num_blocks, block_size, Hkv, D] holding random values in every slot."""
    rng = random.Random(key)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    tables, num_blocks = _random_tables(rng, seq_lens, block_size)
    meta, _ = make_attention_metadata(context_lens, query_lens, tables, block_size, padding)
    num_tokens = sum(query_lens) + padding
    hq, hkv = heads
    q, k, v = (torch.randn(num_tokens, h, head_dim, generator=gen) for h in (hq, hkv, hkv))
    cache = torch.randn(2, num_blocks, block_size, hkv, head_dim, generator=gen)
    return meta, tables, q, k, v, cache


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    context_lens: list[int],
    query_lens: list[int],
    tables: list[list[int]],
    slots: list[int],
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes K/V slot by slot, then attends each query token on its own with explicit softmax
    (over keys pos - window < p <= pos; scores soft-capped when soft_cap is given)."""
    cache = cache.clone()
    block_size = cache.shape[2]
    for t, slot in enumerate(slots):
        if slot >= 0:
            cache[0, slot // block_size, slot % block_size] = k[t]
            cache[1, slot // block_size, slot % block_size] = v[t]
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q)
    t = 0
    for ctx, qlen, table in zip(context_lens, query_lens, tables, strict=True):
        for j in range(qlen):
            pos = ctx + j
            visible = range(0 if window is None else max(0, pos - window + 1), pos + 1)
            keys = torch.stack(
                [cache[0, table[p // block_size], p % block_size] for p in visible]
            )  # [visible, Hkv, D]
            values = torch.stack(
                [cache[1, table[p // block_size], p % block_size] for p in visible]
            )
            for h in range(num_q_heads):
                kv_head = h // group
                scores = (keys[:, kv_head] @ q[t, h]) * scale  # [visible]
                if soft_cap is not None:
                    scores = soft_cap * torch.tanh(scores / soft_cap)
                out[t, h] = torch.softmax(scores, dim=0) @ values[:, kv_head]
            t += 1
    return out, cache


CASES = {
    "mixed": ([0, 20, 45, 3, 16, 0], [37, 1, 13, 1, 16, 1], 3),
    "decode": ([10, 33, 64, 0, 5], [1, 1, 1, 1, 1], 0),
    "prefill": ([0, 0], [40, 7], 0),
    "decode_padded": ([9, 30], [1, 1], 2),
    # equal query lengths and no context: SDPA's is_causal path, no mask
    "prefill_causal": ([0, 0], [24, 24], 0),
    "prefill_one": ([0], [40], 2),
    "decode_many": ([10, 33, 64, 0, 5, 17, 2, 40, 21], [1] * 9, 1),
    # lengths far apart: several groups by length, rows back in batch order
    "spread": ([0, 300, 2, 0, 450, 0, 7], [1, 1, 1, 90, 1, 5, 60], 3),
}


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_matches_reference(
    heads: tuple[int, int], block_size: int, case: str
) -> None:
    context_lens, query_lens, padding = CASES[case]
    # context K/V (and every other slot) hold random values before the step
    meta, tables, q, k, v, cache = random_step(
        f"{case}-{block_size}-{heads}",
        context_lens,
        query_lens,
        padding,
        heads,
        block_size,
        HEAD_DIM,
    )
    scale = HEAD_DIM**-0.5

    want_out, want_cache = _reference(
        q, k, v, cache, context_lens, query_lens, tables, meta.slot_mapping.tolist(), scale
    )
    backend = TorchAttentionBackend()
    got_cache = cache.clone()
    q_in, k_in, v_in = q.clone(), k.clone(), v.clone()
    got = backend.forward(q, k, v, got_cache, meta, scale)

    real = sum(query_lens)
    torch.testing.assert_close(got[:real], want_out[:real], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    # every non-padding slot written, nothing else touched
    assert torch.equal(got_cache, want_cache)
    assert torch.equal(q, q_in) and torch.equal(k, k_in) and torch.equal(v, v_in)


@pytest.mark.parametrize("options", [(1, None), (7, None), (20, None), (None, 2.0), (16, 1.5)])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_window_and_soft_cap(
    case: str, options: tuple[int | None, float | None]
) -> None:
    """Sliding window and logit soft-capping against the reference, in every group kind (decode,
    masked prefill, is_causal prompts, several length groups); blocks wholly before every
    query's window point at another sequence's block (a released block): masked, harmless."""
    window, soft_cap = options
    context_lens, query_lens, padding = CASES[case]
    block_size, (num_q_heads, num_kv_heads) = 16, (4, 2)
    rng = random.Random(f"window-{case}-{options}")
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    tables, num_blocks = _random_tables(rng, seq_lens, block_size)
    if window is not None:
        for table, ctx in zip(tables, context_lens, strict=True):
            for i in range(max(0, ctx - window + 1) // block_size):
                table[i] = tables[0][0]  # released: any block id will do
    meta, _ = make_attention_metadata(context_lens, query_lens, tables, block_size, padding)
    num_tokens = sum(query_lens) + padding
    q = torch.randn(num_tokens, num_q_heads, HEAD_DIM, generator=gen) * 2
    k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=gen)
    slots = meta.slot_mapping.tolist()
    args = (context_lens, query_lens, tables, slots, 0.5)
    want, _ = _reference(q, k, v, cache, *args, window=window, soft_cap=soft_cap)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    got = backend.forward(
        q, k, v, cache.clone(), meta, 0.5, sliding_window=window, logits_soft_cap=soft_cap
    )
    real = sum(query_lens)
    torch.testing.assert_close(got[:real], want[:real], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    if window is not None and soft_cap is None:
        full, _ = _reference(q, k, v, cache, *args)
        if any(n > window for n in seq_lens):
            assert not torch.allclose(got[:real], full[:real], atol=1e-3)


def test_window_masks_are_built_once_per_step() -> None:
    """Layers with the same window share one mask per step; a new step builds new ones."""
    context_lens, query_lens, _ = CASES["mixed"]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    tables, num_blocks = _random_tables(random.Random(3), seq_lens, 16)
    meta, _ = make_attention_metadata(context_lens, query_lens, tables, 16)
    gen = torch.Generator().manual_seed(3)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, HEAD_DIM, generator=gen) for h in (4, 2, 2))
    cache = torch.randn(2, num_blocks, 16, 2, HEAD_DIM, generator=gen)
    backend = TorchAttentionBackend()
    backend.prepare(meta)
    plan = backend._plan
    assert plan is not None
    for window in (8, None, 8, 30, 8):
        backend.forward(q, k, v, cache, meta, 0.3, sliding_window=window)
    masks = [dict(g.window_masks) for g in plan.groups]
    for window in (8, 30):
        backend.forward(q, k, v, cache, meta, 0.3, sliding_window=window)
    assert [dict(g.window_masks) for g in plan.groups] == masks  # same tensors, none rebuilt
    assert any({8, 30} <= set(m) for m in masks)
    with pytest.raises(ValueError, match="sliding_window"):
        backend.forward(q, k, v, cache, meta, 0.3, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        backend.forward(q, k, v, cache, meta, 0.3, logits_soft_cap=0.0)


@pytest.mark.parametrize("case", ["decode_many", "prefill_causal", "mixed"])
def test_torch_backend_16bit(case: str) -> None:
    """bfloat16 (masked, is_causal and decode groups) against the float32 reference on the same
    rounded inputs."""
    context_lens, query_lens, padding = CASES[case]
    rng = random.Random(f"bf16-{case}")
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    tables, num_blocks = _random_tables(rng, seq_lens, 16)
    meta, _ = make_attention_metadata(context_lens, query_lens, tables, 16, padding)
    num_tokens = sum(query_lens) + padding
    q, k, v = (
        torch.randn(num_tokens, heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
        for heads in (4, 2, 2)
    )
    cache = torch.randn(2, num_blocks, 16, 2, HEAD_DIM, generator=gen).to(torch.bfloat16)
    scale = HEAD_DIM**-0.5
    want, _ = _reference(
        q.float(),
        k.float(),
        v.float(),
        cache.float(),
        context_lens,
        query_lens,
        tables,
        meta.slot_mapping.tolist(),
        scale,
    )
    got = TorchAttentionBackend().forward(q, k, v, cache, meta, scale)
    real = sum(query_lens)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got[:real].float(), want[:real], atol=3e-2, rtol=3e-2)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))


def test_length_buckets() -> None:
    """Sequences of very different lengths are split into groups of similar length (each
    group's work is its size x longest query x longest sequence); alike ones stay together in
    batch order."""
    from engine.worker.attention.torch_ref import MAX_GROUPS, _length_buckets

    # decode: 50 short and 50 long sequences, interleaved
    seq_lens = [40 + i % 3 if i % 2 == 0 else 900 + i % 5 for i in range(100)]
    groups = _length_buckets(list(range(100)), [1] * 100, seq_lens)
    assert sorted(map(sorted, groups)) == [list(range(0, 100, 2)), list(range(1, 100, 2))]
    # alike lengths: one group, batch order kept (no reordering gather)
    assert _length_buckets([0, 1, 2], [1, 1, 1], [500, 502, 501]) == [[0, 1, 2]]
    # prefill: new prompts of 32..512 tokens are not padded to the longest
    qlens = [512, 32, 256, 64, 480, 128]
    groups = _length_buckets(list(range(6)), qlens, qlens)
    assert 2 <= len(groups) <= MAX_GROUPS
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert not any({0, 1} <= set(g) for g in groups)


def test_prepare_is_optional_and_plans_are_not_stale() -> None:
    block_size, heads = 16, (4, 2)
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    steps = [([0, 5], [20, 3]), ([20, 8], [1, 1])]
    backend_a, backend_b = TorchAttentionBackend(), TorchAttentionBackend()
    tables, num_blocks = _random_tables(rng, [21, 9], block_size)
    cache = torch.randn(2, num_blocks, block_size, heads[1], HEAD_DIM, generator=gen)
    cache_a, cache_b = cache.clone(), cache.clone()
    for context_lens, query_lens in steps:
        meta, _ = make_attention_metadata(context_lens, query_lens, tables, block_size)
        t = sum(query_lens)
        q = torch.randn(t, heads[0], HEAD_DIM, generator=gen)
        k = torch.randn(t, heads[1], HEAD_DIM, generator=gen)
        v = torch.randn(t, heads[1], HEAD_DIM, generator=gen)
        backend_a.prepare(meta)
        for _layer in range(2):  # the same plan serves every layer of a step
            out_a = backend_a.forward(q, k, v, cache_a, meta, 0.3)
            out_b = backend_b.forward(q, k, v, cache_b, meta, 0.3)
            assert torch.equal(out_a, out_b)
    assert torch.equal(cache_a, cache_b)


def test_factory() -> None:
    cpu = torch.device("cpu")
    assert isinstance(get_attention_backend("torch", cpu), TorchAttentionBackend)
    # auto on the CPU: the C++ kernel when it builds (test_cpu_paged.py), else torch
    assert get_attention_backend("auto", cpu).name in ("cpu", "torch")
    with pytest.raises(ValueError, match="CUDA"):
        get_attention_backend("cupy", cpu)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", cpu)
