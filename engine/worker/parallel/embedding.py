"""The vocabulary-parallel embedding: each rank holds its slice of the token rows, looks up the
ids that fall in it (zeros elsewhere), and the ranks sum their rows (Megatron)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.worker.parallel.group import TPGroup


class VocabParallelEmbedding(nn.Module):
    """`weight`: [this rank's ids, hidden], rows [start, start + n) of the full embedding."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.num_rows = tp.vocab(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden, dtype=dtype))

    def tp_slices(self) -> dict[str, tuple[int, int, int] | None]:
        """Checkpoint name -> (dim, start, length) this rank reads."""
        return {"weight": (0, self.start, self.num_rows)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, hidden], every rank's rows summed."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_rows)  # [T]
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        h.masked_fill_(outside.unsqueeze(-1), 0)
        self.tp.all_reduce(h)
        return h
