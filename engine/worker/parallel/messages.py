"""What rank 0 and the other ranks say to each other: typed messages, pickled over one socket pair
per worker (multiprocessing Connections). A step's batch is a few small integer arrays, so a pipe
costs tens of microseconds a step and needs no fixed shapes, no second collective and no
shared-memory bookkeeping; its end-of-file is also how a worker learns that the core is gone.

    rank 0 -> worker:  WorkerSpec (first), Calibrate, Allocate, then per step DiskOps (rank 0's
                       disk and remote writes and disk deletes, repeated first), Probe, Step
                       (with this step's remote loads' shares); Stop
    worker -> rank 0:  Ready | Failed, Probed (the answer to a Probe)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.config import EngineConfig
from engine.kv.hashing import BlockHash
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
class Step:
    """One step: the plan's copies, then the forward over the batch."""

    plan: KVPlan
    """The step's copies; each rank applies them to its own cache and CPU tier."""
    batch: StepBatch | None
    """None: a plan-only step (nothing scheduled)."""
    logit_rows: list[int]
    """Flat token indices whose logits rank 0 samples from (every rank computes its slice)."""
    remote_shares: dict[BlockHash, list[torch.Tensor]] | None = None
    """The plan's remote loads: hash -> the verified payloads of ranks 1..N-1, in rank order
    (rank 0's lookup read and checked every rank's share)."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A worker's first message: who it is and what it runs."""

    config: EngineConfig
    """The engine's config, dtype resolved."""
    rank: int
    world: int
    store_path: str
    """The FileStore the group meets in."""
    num_threads: int
    parent_pid: int


@dataclass(frozen=True, slots=True)
class Calibrate:
    """Join rank 0's fp8 KV-scale calibration pass over these prompts (engine/worker/
    kv_calibration.py): the ranks meet in its collectives."""

    prompts: list[list[int]]


@dataclass(frozen=True, slots=True)
class Allocate:
    """Allocate the KV cache and the CPU tier, open this rank's disk folder, then answer Ready."""

    num_device_blocks: int
    num_cpu_blocks: int
    disk_manifest: dict[str, Any] | None
    """Rank 0's disk manifest (each rank opens its own folder), or None: no disk tier."""
    remote_manifest: dict[str, Any] | None
    """Rank 0's manifest for the remote tier (each rank writes its share under its own tag),
    or None: no remote tier."""
    kv_scales: dict[str, Any] | None
    """An fp8 cache's scales (KVScales.to_json), or None: the model's dtype."""


@dataclass(frozen=True, slots=True)
class DiskOps:
    """Rank 0's disk writes and deletes since the last message, repeated on this rank's share."""

    ops: list[Any]


@dataclass(frozen=True, slots=True)
class Probe:
    """Does this rank hold (and has it verified) its share of the block on disk? (Probed)"""

    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class Stop:
    """Flush the disk tier and exit."""


@dataclass(frozen=True, slots=True)
class Ready:
    """The worker's model and caches are up."""

    remote_share: tuple[bytes, int] | None = None
    """(layout tag, payload bytes) of this rank's remote values: rank 0 reads every rank's
    share."""


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


@dataclass(frozen=True, slots=True)
class Probed:
    found: bool
