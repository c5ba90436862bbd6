"""Attention metadata of hand-made flat batches, for the kernel and model tests."""

from __future__ import annotations

from typing import Any


def make_attention_metadata(
    context_lens: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_padding_tokens: int = 0,
    device: str = "cpu",
) -> tuple[Any, Any]:
    """AttentionMetadata of one flat batch, plus the [T] int64 positions of its tokens.

    Sequence i has context_lens[i] cached tokens and query_lens[i] new ones; padding tokens
    (slot -1, position 0) are appended after the last sequence.
    """
    import torch

    from engine.worker.attention.base import AttentionMetadata

    slots: list[int] = []
    positions: list[int] = []
    for ctx, qlen, table in zip(context_lens, query_lens, block_tables, strict=True):
        for pos in range(ctx, ctx + qlen):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
    slots += [-1] * num_padding_tokens
    positions += [0] * num_padding_tokens
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    width = max(len(t) for t in block_tables)
    starts = [0]
    for qlen in query_lens:
        starts.append(starts[-1] + qlen)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32, device=device
        ),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)
