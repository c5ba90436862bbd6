"""One tensor-parallel group: this process's rank, the world size, and the torch.distributed
process group the model's collectives run on (gloo on the CPU, NCCL on CUDA).

The group is a ProcessGroup object of its own over a FileStore, not torch.distributed's default
group: no process-global state, so one process can build, close and rebuild engines (tests, the
offline `LLM`) without init_process_group / destroy_process_group pairs.

Head and vocabulary split (Megatron): when K >= N, the K KV heads are split as evenly as N
allows, the first K % N ranks holding one more (3 over 2 ranks: [2, 1]), and each rank holds the
query heads of its KV heads' groups (G = H / K each: [6, 3] for SmolLM2's 9 / 3), so q/k/v and
o_proj shards may differ in size between ranks. When K < N, rank r holds the one KV head
r // (N / K), replicated on N / K ranks, and the query heads [r * H / N, (r + 1) * H / N) (each a
reader of that head). Vocabulary rows [r * ceil(V / N), ...), the last rank's slice shorter when N
does not divide V; the MLP's intermediate rows are split evenly.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 60.0
"""A collective whose peers do not all arrive within this fails instead of hanging (a dead
rank usually fails it at once: its sockets close)."""


@dataclass(eq=False, repr=False)
class TPGroup:
    rank: int
    world: int
    pg: Any
    """The backend ProcessGroup (ProcessGroupGloo / ProcessGroupNCCL)."""

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sums `t` over the ranks, in place (row-parallel outputs, the vocab-parallel embedding)."""
        self.pg.allreduce([t]).wait()

    def all_reduce_max(self, t: torch.Tensor) -> None:
        """Elementwise maximum over the ranks, in place (fp8 KV-scale calibration)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
        self.pg.allreduce([t], opts).wait()

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """local: [rows, this rank's vocab slice] -> [rows, vocab_size] on every rank (all-gather;
        slices are padded to ceil(V / N) columns and the padding cut off)."""
        per = vocab_rows(vocab_size, self.world, 0)[1]
        if local.shape[-1] != per:
            local = torch.nn.functional.pad(local, (0, per - local.shape[-1]))
        local = local.contiguous()
        outs = [torch.empty_like(local) for _ in range(self.world)]
        self.pg.allgather([outs], [local]).wait()
        return torch.cat(outs, dim=-1)[..., :vocab_size]

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(first query head, query heads) of this rank."""
        return q_head_range(num_heads, num_kv_heads, self.rank, self.world)

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads) of this rank; one replicated head when K < N."""
        return kv_head_range(num_kv_heads, self.rank, self.world)

    def rows(self, size: int) -> tuple[int, int]:
        """(first row, rows) of an evenly split dimension (intermediate size)."""
        per = size // self.world
        return self.rank * per, per

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """(first token id, ids) of this rank's vocabulary slice."""
        return vocab_rows(vocab_size, self.world, self.rank)


def kv_head_range(num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """(first KV head, KV heads): K >= N split as evenly as possible, the first K % N ranks one
    more; K < N one head per rank, replicated on N / K ranks."""
    if num_kv_heads >= world:
        per, extra = divmod(num_kv_heads, world)
        return rank * per + min(rank, extra), per + (rank < extra)
    return rank // (world // num_kv_heads), 1


def q_head_range(num_heads: int, num_kv_heads: int, rank: int, world: int) -> tuple[int, int]:
    """(first query head, query heads): the groups of this rank's KV heads when K >= N, else an
    even 1 / N of the heads (all of them readers of this rank's replicated KV head)."""
    if num_kv_heads >= world:
        group = num_heads // num_kv_heads
        first, count = kv_head_range(num_kv_heads, rank, world)
        return first * group, count * group
    per = num_heads // world
    return rank * per, per


def vocab_rows(vocab_size: int, world: int, rank: int) -> tuple[int, int]:
    per = -(-vocab_size // world)
    start = min(rank * per, vocab_size)
    return start, min(per, vocab_size - start)


def check_shapes(hf_config: Any, world: int, supported: bool, arch: str) -> None:
    """ValueError, said plainly, when `world` ranks cannot split this model."""
    if not supported:
        raise ValueError(
            f"tensor parallelism supports the Llama family (Llama, Mistral, SmolLM2) and Qwen2; "
            f"{arch} is not supported with tensor_parallel_size={world}"
        )
    heads = int(hf_config.num_attention_heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    inter = int(hf_config.intermediate_size)
    problems = []
    # K >= N: any K splits (unevenly when N does not divide it), each rank keeping whole groups.
    # K < N: each KV head is replicated on N / K ranks that share its query heads evenly, which
    # needs N / K whole and H / N whole (a rank's query heads all read its one KV head).
    if kv < world and world % kv:
        problems.append(
            f"{world} ranks cannot replicate num_key_value_heads {kv} evenly "
            f"({world} is not a multiple of {kv})"
        )
    elif kv < world and heads % world:
        problems.append(
            f"num_attention_heads {heads} is not a multiple of {world} (with fewer KV heads "
            f"than ranks each rank holds an equal share of the query heads)"
        )
    if inter % world:
        problems.append(
            f"intermediate_size {inter} is not a multiple of {world} (the MLP rows split evenly)"
        )
    if problems:
        raise ValueError(
            f"tensor_parallel_size={world} cannot split this model: " + "; ".join(problems)
        )


def init_group(rank: int, world: int, store_path: str, device: torch.device) -> TPGroup:
    """Joins the group (blocks until every rank has; fails after COLLECTIVE_TIMEOUT_S)."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    store = dist.FileStore(store_path, world)
    store.set_timeout(timeout)
    pg: Any
    if device.type == "cuda":  # NOTE: unverified on more than one GPU (README)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world, opts)
    else:
        pg = dist.ProcessGroupGloo(store, rank, world, timeout)
    group = TPGroup(rank, world, pg)
    group.all_reduce(torch.zeros(1, device=device))  # every rank is in
    return group
