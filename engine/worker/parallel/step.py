"""What rank 0 sends the other ranks each step: the KV plan and the flat batch as host arrays.

Messages travel pickled over one socket pair per worker (multiprocessing Connections): a step's
batch is a few small integer arrays, so a pipe costs tens of microseconds a step and needs no
fixed shapes, no second collective and no shared-memory bookkeeping; its end-of-file is also how
a worker learns that the core is gone.

    core -> worker:  ("alloc", num_device_blocks, num_cpu_blocks, disk manifest | None)
                     | ("disk", [DiskOp]) (rank 0's disk writes and deletes, repeated first)
                     | ("probe", block hash) (answered: does this rank hold its share on disk)
                     | ("step", StepMessage) | ("disk-only",) | ("stop",)
    worker -> core:  ("ready",) | ("failed", message) | ("probe", found)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.kv.plan import KVPlan
from engine.worker.attention.base import AttentionMetadata

if TYPE_CHECKING:
    from engine.worker.input_batch import InputBatch, StepInputs


@dataclass(slots=True)
class StepBatch:
    """A step's flat batch as host arrays (engine/worker/input_batch.py's buffers, cut to size)."""

    input_ids: np.ndarray
    """[T] int64"""
    positions: np.ndarray
    """[T] int64"""
    slot_mapping: np.ndarray
    """[T] int64"""
    query_start_loc: np.ndarray
    """[S + 1] int32"""
    seq_lens: np.ndarray
    """[S] int32"""
    block_tables: np.ndarray
    """[S, max_blocks] int32"""
    query_lens: list[int]
    max_query_len: int
    max_seq_len: int

    @classmethod
    def of(cls, inputs: InputBatch, step: StepInputs) -> StepBatch:
        t, s = step.input_ids.shape[0], step.meta.num_seqs
        return cls(
            inputs.input_ids.np[:t],
            inputs.positions.np[:t],
            inputs.slot_mapping.np[:t],
            inputs.query_start_loc.np[: s + 1],
            inputs.seq_lens.np[:s],
            inputs.block_tables.np[:s],
            step.meta.query_lens_cpu,
            step.meta.max_query_len,
            step.meta.max_seq_len,
        )

    def to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) on `device`."""

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        meta = AttentionMetadata(
            slot_mapping=dev(self.slot_mapping),
            query_start_loc=dev(self.query_start_loc),
            seq_lens=dev(self.seq_lens),
            block_tables=dev(self.block_tables),
            query_lens_cpu=self.query_lens,
            seq_lens_cpu=self.seq_lens.tolist(),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
        )
        return dev(self.input_ids), dev(self.positions), meta


@dataclass(slots=True)
class StepMessage:
    plan: KVPlan
    """The step's copies; each rank applies them to its own cache and CPU tier."""
    batch: StepBatch | None
    """None: a plan-only step (nothing scheduled)."""
    logit_rows: list[int]
    """Flat token indices whose logits rank 0 samples from (every rank computes its slice)."""
