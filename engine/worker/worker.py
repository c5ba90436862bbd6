"""One rank of the engine (vLLM V1's Worker): its device, its shard of the model, its paged KV
cache with the CPU and disk tiers' tensors and files, and on rank 0 the model runner.

Every rank runs this class. Rank 0 lives in the engine core's process, where the executor calls
it directly (engine/executor/); under tensor parallelism ranks 1..N-1 live in processes of their
own (engine/worker/parallel/worker.py) and run the flat batch rank 0 sends each step
(`run_step`). Only rank 0 samples: the other ranks compute their heads' share of every layer and
join its collectives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.kv_io.offload import KVOffload
from engine.kv_io.tier_setup import TPShare, open_disk, open_remote
from engine.sample.sampler import Sampler, host_to_device
from engine.worker.attention import get_attention_backend
from engine.worker.attention.kv_quant import KVScales, kv_block_bytes
from engine.worker.draft_runner import DraftModel, DraftRunner
from engine.worker.kv_calibration import calibration_pass, kv_cache_storage
from engine.worker.model_loader import kv_dims, load_model
from engine.worker.model_runner import ModelRunner, apply_plan
from engine.worker.parallel.group import TPGroup
from engine.worker.parallel.messages import Allocate, Step

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the engine core needs to know of the loaded model."""

    hf_config: Any
    num_layers: int
    num_kv_heads: int
    """The model's KV heads; each rank's cache holds `rank_kv_heads` of them."""
    head_dim: int
    first_kv_head: int
    rank_kv_heads: int
    vocab_size: int


def model_shape(hf_config: Any, group: TPGroup | None) -> ModelShape:
    num_layers, num_kv_heads, head_dim = kv_dims(hf_config)
    first, count = (0, num_kv_heads) if group is None else group.kv_heads(num_kv_heads)
    vocab = int(hf_config.vocab_size)
    return ModelShape(hf_config, num_layers, num_kv_heads, head_dim, first, count, vocab)


def rank_device(name: str, rank: int) -> torch.device:
    """This rank's device: cuda:rank on CUDA (set as the current device), else the CPU."""
    if name == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device(name)


class Worker:
    """One rank: loads its shard of the model at construction; then `allocate_kv_cache`, and on
    rank 0 `init_runner` (the runner is what the executor launches steps on)."""

    def __init__(self, config: EngineConfig, group: TPGroup | None = None) -> None:
        self.config = config
        self.group = group
        self.rank = 0 if group is None else group.rank
        self.device = rank_device(config.device, self.rank)
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.model, hf_config = load_model(config.model, self.device, self.backend, group)
        self.shape = model_shape(hf_config, group)
        self.kv_dtype = kv_cache_storage(
            config.cache.kv_cache_dtype, self.model.dtype, self.backend
        )
        """The KV cache's storage dtype on every tier (fp8: quantized with the KV scales)."""
        self.kv_cache: torch.Tensor | None = None
        """[num_layers, 2, num_blocks, block_size, rank_kv_heads, head_dim]"""
        self.offload: KVOffload | None = None
        """The CPU tier's tensor and the disk tier's files (None: no lower tiers)."""
        self.runner: ModelRunner | None = None
        spec = config.speculative
        self.draft: DraftModel | None = None
        """Speculative decoding's draft model (method draft_model; rank 0 only)."""
        if spec is not None and spec.model is not None and self.rank == 0:
            self.draft = DraftModel.load(
                spec.model, config.model, self.device, config.attention_backend
            )
        self.drafter: DraftRunner | None = None

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        """One layer's block in this rank's cache: (block_size, rank_kv_heads, head_dim)."""
        return (self.config.cache.block_size, self.shape.rank_kv_heads, self.shape.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of this rank's cache (every layer, K and V)."""
        bs, heads, dim = self.layer_shape
        return kv_block_bytes(self.shape.num_layers, bs, heads, dim, self.kv_dtype)

    @property
    def draft_block_bytes(self) -> int:
        """Bytes of one block of the draft model's cache (0: no draft model)."""
        return 0 if self.draft is None else self.draft.block_bytes(self.config.cache.block_size)

    @property
    def tp_share(self) -> TPShare | None:
        """This rank's share of every block under tensor parallelism (None: N = 1)."""
        g, s = self.group, self.shape
        return None if g is None else TPShare(g.rank, g.world, s.first_kv_head, s.rank_kv_heads)

    def calibrate(self, prompts: list[list[int]]) -> KVScales:
        """An fp8 cache's scales from one forward over `prompts` (every rank runs it)."""
        return calibration_pass(
            self.model, self.backend, prompts, (self.shape.num_layers, *self.layer_shape)
        )

    def allocate_kv_cache(self, num_blocks: int, kv_scales: KVScales | None) -> torch.Tensor:
        """The device cache of `num_blocks` blocks, bound to the attention backend."""
        shape = (self.shape.num_layers, 2, num_blocks, *self.layer_shape)
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.backend.bind_kv_cache(self.kv_cache, kv_scales)
        if self.draft is not None:  # the same blocks, in the draft model's own cache
            bs = self.config.cache.block_size
            self.drafter = self.draft.runner(num_blocks, bs, self.shape.vocab_size)
        return self.kv_cache

    def allocate(self, msg: Allocate) -> None:
        """Ranks 1..N-1: the device cache, the CPU tier and this rank's disk folder."""
        scales = None if msg.kv_scales is None else KVScales.from_json(msg.kv_scales, "rank 0")
        cache = self.allocate_kv_cache(msg.num_device_blocks, scales)
        if not msg.num_cpu_blocks:
            return
        shape = (self.shape.num_layers, 2, msg.num_cpu_blocks, *self.layer_shape)
        cpu = torch.zeros(shape, dtype=cache.dtype, pin_memory=cache.is_cuda)
        disk = remote = None
        if msg.disk_manifest is not None:  # rank 0's manifest: this rank's folder and share
            disk = open_disk(self.config.cache, msg.disk_manifest, self.block_bytes, self.tp_share)
        if msg.remote_manifest is not None:  # this rank's share, under its own tag
            cc = self.config.cache
            remote = open_remote(cc, msg.remote_manifest, self.block_bytes, self.tp_share)
        self.offload = KVOffload(cpu, disk, remote=remote)

    def init_runner(self, eos_token_ids: tuple[int, ...], max_model_len: int) -> ModelRunner:
        """Rank 0: the sampler and the model runner (decode CUDA graphs captured here)."""
        assert self.kv_cache is not None, "allocate_kv_cache first"
        self.runner = ModelRunner(
            self.model,
            self.backend,
            self.kv_cache,
            Sampler(self.shape.vocab_size, self.device, self.config.seed),
            self.config.cache.block_size,
            eos_token_ids,
            self.device,
            offload=self.offload,
            tensor_parallel=self.group is not None,
            max_graph_batch=self.config.cuda_graph_batch(),
            max_model_len=max_model_len,
            drafter=self.drafter,
        )
        return self.runner

    @torch.inference_mode()
    def run_step(self, step: Step) -> None:
        """Ranks 1..N-1: the plan's copies on this rank's share of each block, then the forward
        over rank 0's flat batch (its collectives meet rank 0's)."""
        cache = self.kv_cache
        assert cache is not None
        remote = None if self.offload is None else self.offload.remote
        if step.remote_shares and remote is not None:
            remote.accept([(h, shares[self.rank - 1]) for h, shares in step.remote_shares.items()])
        apply_plan(step.plan, cache, self.offload, self.backend)
        if self.offload is not None and self.offload.disk is not None:
            self.offload.disk.end_step()
        if step.remote_shares and remote is not None:
            remote.drop(list(step.remote_shares))
        if step.batch is None:
            return
        input_ids, positions, meta = step.batch.to(self.device)
        self.backend.prepare(meta)
        hidden = self.model(input_ids, positions, cache, meta)  # [T, hidden]
        if step.logit_rows:
            idx = host_to_device(step.logit_rows, torch.int64, self.device)
            self.model.compute_logits(hidden.index_select(0, idx))  # joins the vocab gather

    def close(self) -> None:
        """Ranks 1..N-1: flushes the disk tier's queued writes (rank 0's offload is closed by the
        engine core, after its last writes)."""
        if self.rank and self.offload is not None:
            self.offload.close()
