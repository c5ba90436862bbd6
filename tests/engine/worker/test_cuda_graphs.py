"""Decode CUDA graphs' bookkeeping, on the CPU: the sizes captured, the bucket a step replays,
and what a replay's inputs hold (padding rows, block-table widths). The capture and replay
themselves run in tests/gpu/test_cuda_graphs.py."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.worker import cuda_graphs
from engine.worker.attention.base import AttentionMetadata
from engine.worker.cuda_graphs import DecodeGraphs, _Graph, bucket, graph_sizes


def test_graph_sizes_follow_vllms_schedule() -> None:
    assert graph_sizes(0) == []
    assert graph_sizes(1) == [1]
    assert graph_sizes(6) == [1, 2, 4, 6]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a == 8 for a, b in itertools.pairwise(sizes[3:]))


def test_bucket_is_the_smallest_size_that_holds_the_batch() -> None:
    sizes = graph_sizes(64)
    assert [bucket(sizes, n) for n in (1, 3, 5, 8, 9, 17, 64)] == [1, 4, 8, 8, 16, 24, 64]
    assert bucket(sizes, 65) is None


def test_enforce_eager_and_the_cap_set_the_largest_graph() -> None:
    cfg = EngineConfig.from_kwargs("m", max_num_seqs=48)
    assert cfg.cuda_graph_batch() == 48
    assert EngineConfig.from_kwargs("m", max_cuda_graph_batch=16).cuda_graph_batch() == 16
    assert EngineConfig.from_kwargs("m", enforce_eager=True).cuda_graph_batch() == 0
    with pytest.raises(ValueError, match="max_cuda_graph_batch"):
        EngineConfig.from_kwargs("m", max_cuda_graph_batch=-1)


def _no_backend() -> Any:
    """The graphs' bookkeeping never calls the backend (only the capture does)."""
    return SimpleNamespace()


class _Recorder:
    """Stands in for a captured graph: a replay copies the graphs' input buffers."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.graphs = graphs
        self.seen: list[dict[str, torch.Tensor]] = []

    def replay(self) -> None:
        g = self.graphs
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")
        self.seen.append({n: getattr(g, n).clone() for n in names})


def _decode_meta(seq_lens: list[int], tables: list[list[int]], width: int) -> AttentionMetadata:
    bt = torch.zeros((len(tables), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    slots = [t[(s - 1) // 4] * 4 + (s - 1) % 4 for t, s in zip(tables, seq_lens, strict=True)]
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=bt,
        query_lens_cpu=[1] * n,
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> tuple[DecodeGraphs, dict[int, _Recorder]]:
    monkeypatch.setattr(cuda_graphs, "num_sms", lambda device: 132)
    model: Any = SimpleNamespace(
        config=SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    )
    kv = torch.zeros((1, 2, 16, 4, 2, 8))
    g = DecodeGraphs(model, _no_backend(), kv, block_size=4, max_model_len=32, sizes=[1, 2, 4, 8])
    recorders = {}
    for size in g.sizes:
        recorders[size] = _Recorder(g)
        g.graphs[size] = _Graph(recorders[size], torch.full((size, 5), float(size)))
    return g, recorders


def test_a_replay_pads_to_its_bucket(graphs: tuple[DecodeGraphs, dict[int, _Recorder]]) -> None:
    g, rec = graphs
    tables = [[3, 4], [5], [6, 7, 8]]
    meta = _decode_meta([6, 2, 9], tables, width=16)  # wider than the graphs' 8 columns
    ids, pos = torch.tensor([11, 12, 13]), torch.tensor([5, 1, 8])
    logits = g.run(ids, pos, meta)
    assert logits is not None and logits.shape == (3, 5) and float(logits[0, 0]) == 4.0
    (seen,) = rec[4].seen
    assert seen["input_ids"][:3].tolist() == [11, 12, 13]
    assert seen["positions"][:3].tolist() == [5, 1, 8]
    assert seen["slot_mapping"][:4].tolist() == [4 * 4 + 1, 5 * 4 + 1, 8 * 4 + 0, -1]
    assert seen["seq_lens"][:4].tolist() == [6, 2, 9, 1]
    assert seen["block_tables"][:3, :3].tolist() == [[3, 4, 0], [5, 0, 0], [6, 7, 8]]
    assert g.replays == 1


def test_a_smaller_step_after_a_larger_one_pads_again(
    graphs: tuple[DecodeGraphs, dict[int, _Recorder]],
) -> None:
    """Row 3 held a real sequence in the 4-row step; in the 3-row step (same graph) it is padding
    again: slot -1 (no KV write) and length 1."""
    g, rec = graphs
    g.run(torch.arange(4), torch.ones(4, dtype=torch.int64), _decode_meta([2] * 4, [[1]] * 4, 8))
    assert rec[4].seen[-1]["slot_mapping"][3].item() == 1 * 4 + 1
    g.run(torch.arange(3), torch.ones(3, dtype=torch.int64), _decode_meta([6] * 3, [[1, 2]] * 3, 8))
    last = rec[4].seen[-1]
    assert last["slot_mapping"][3].item() == -1 and last["seq_lens"][3].item() == 1
    assert last["seq_lens"][:3].tolist() == [6, 6, 6]


def test_steps_that_must_run_eager(graphs: tuple[DecodeGraphs, dict[int, _Recorder]]) -> None:
    g, _ = graphs
    too_many = _decode_meta([2] * 9, [[1]] * 9, width=8)
    assert g.run(torch.arange(9), torch.ones(9, dtype=torch.int64), too_many) is None
    prefill = _decode_meta([5], [[1, 2]], width=8)
    prefill.query_lens_cpu, prefill.max_query_len = [2], 2
    assert g.size_for(prefill, num_tokens=2) is None
    assert g.replays == 0


def test_long_contexts_of_few_sequences_keep_split_k(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graphs, "num_sms", lambda device: 132)
    model: Any = SimpleNamespace(
        config=SimpleNamespace(num_attention_heads=32, num_key_value_heads=8)
    )
    kv = torch.zeros((1, 2, 4, 16, 8, 8))
    g = DecodeGraphs(model, _no_backend(), kv, block_size=16, max_model_len=8192, sizes=[1, 2])
    short = _decode_meta([1000], [[0] * 250], width=256)
    long = _decode_meta([4000], [[0] * 1000], width=1024)
    assert g.size_for(short, 1) == 1
    assert g.size_for(long, 1) is None  # the eager path splits a 4000-token context 8 ways
