"""InputBatch against a plain-Python reference of the flat batch, over steps that reuse its buffers."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine.worker.input_batch import InputBatch

BS = 4


@dataclass
class _Seq:
    token_ids: list[int]


@dataclass
class _Item:
    seq: _Seq
    start: int
    num_new_tokens: int


def _reference(items: list[_Item], tables: list[list[int]]) -> dict[str, list]:
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    for item, table in zip(items, tables, strict=True):
        for p in range(item.start, item.start + item.num_new_tokens):
            ids.append(item.seq.token_ids[p])
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
        qsl.append(qsl[-1] + item.num_new_tokens)
        lens.append(item.start + item.num_new_tokens)
    width = max(len(t) for t in tables)
    rows = [t + [0] * (width - len(t)) for t in tables]
    return {"ids": ids, "pos": pos, "slots": slots, "qsl": qsl, "lens": lens, "rows": rows}


def _random_step(rng: random.Random, decode_only: bool) -> tuple[list[_Item], list[list[int]]]:
    items, tables = [], []
    for _ in range(rng.randint(1, 40)):
        total = rng.randint(1, 90)
        start = total - 1 if decode_only else rng.randint(0, total - 1)
        seq = _Seq([rng.randrange(1000) for _ in range(total)])
        items.append(_Item(seq, start, total - start))
        tables.append([rng.randrange(1, 500) for _ in range(-(-total // BS))])
    return items, tables


def test_matches_reference_across_steps_and_growth() -> None:
    rng = random.Random(0)
    batch = InputBatch(BS, torch.device("cpu"))
    for step in range(60):
        items, tables = _random_step(rng, decode_only=step % 3 == 0)
        seqs = [i.seq for i in items]
        starts = [i.start for i in items]
        qlens = [i.num_new_tokens for i in items]
        got = batch.build(seqs, starts, qlens, tables)  # type: ignore[arg-type]
        ref = _reference(items, tables)
        meta = got.meta
        assert got.input_ids.tolist() == ref["ids"]
        assert got.positions.tolist() == ref["pos"]
        assert meta.slot_mapping.tolist() == ref["slots"]
        assert meta.query_start_loc.tolist() == ref["qsl"]
        assert meta.seq_lens.tolist() == ref["lens"] == meta.seq_lens_cpu
        assert meta.query_lens_cpu == [i.num_new_tokens for i in items]
        assert meta.max_query_len == max(meta.query_lens_cpu)
        assert meta.max_seq_len == max(ref["lens"])
        # whole rows, right-padded with 0, however long earlier steps' tables were
        width = len(ref["rows"][0])
        rows = meta.block_tables.tolist()
        assert len(rows) == len(items) and meta.block_tables.is_contiguous()
        assert [r[:width] for r in rows] == ref["rows"]
        assert all(v == 0 for r in rows for v in r[width:])
        assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
