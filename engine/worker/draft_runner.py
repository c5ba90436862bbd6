"""Speculative decoding's draft model (method "draft_model"), on rank 0's worker.

A smaller model with the target's tokenizer proposes tokens greedily. It keeps a paged KV cache
of its own with the target's block size and block ids: the target's block table of a sequence
addresses both caches, so the KV manager's allocation, prefix caching, forks and copy-on-write
serve the draft too (the plan's copies are applied to both). To keep its cache filled, the draft
model runs over every token the target computes, each step, before the target's forward (its
prefill costs what its size costs). For the sequences the scheduler gave a proposal of k tokens
(`StepRecord.propose`) that pass also yields the first proposed token (the argmax at the
sequence's last token); k - 1 one-token passes over those sequences yield the rest, their KV
written past the sequence's computed tokens, where the next steps overwrite it like the
target's. The proposed tokens then go into the target's forward as core-proposed ones do
(engine/worker/model_runner.py's `Verifier`).

Blocks that come back from the CPU or disk tier hold the target's KV only: the draft's KV for
them is stale, which costs acceptance (its proposals are worse), never correctness.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.sample.sampler import host_to_device
from engine.worker.attention import get_attention_backend
from engine.worker.attention.base import AttentionBackend
from engine.worker.attention.kv_quant import kv_block_bytes
from engine.worker.input_batch import InputBatch
from engine.worker.model_loader import kv_dims, load_model, load_tokenizer
from engine.worker.seq_state import SeqState
from engine.worker.step_record import StepRecord


def check_draft_model(target: str | Path, draft: str | Path) -> None:
    """ValueError unless the draft model's tokenizer is the target's (same vocabulary, same ids):
    its proposals are token ids the target verifies."""
    try:
        mine, theirs = load_tokenizer(target), load_tokenizer(draft)
    except (OSError, ValueError) as e:
        raise ValueError(f"the draft model {str(draft)!r} cannot be read: {e}") from e
    if mine.get_vocab() != theirs.get_vocab():
        raise ValueError(
            f"the draft model {str(draft)!r} has another tokenizer than the target "
            f"{str(target)!r} ({len(theirs.get_vocab())} vs {len(mine.get_vocab())} tokens, or "
            "other ids): speculative decoding needs a draft model with the same tokenizer"
        )


@dataclass(eq=False)
class DraftModel:
    """The draft model, loaded next to the target (rank 0), before its cache is allocated."""

    model: Any
    backend: AttentionBackend
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def load(
        cls, path: str, target: ModelConfig, device: torch.device, attention_backend: str
    ) -> DraftModel:
        check_draft_model(target.path, path)
        backend = get_attention_backend(attention_backend, device)
        config = ModelConfig(path=path, dtype=target.dtype, quantization=target.quantization)
        model, hf_config = load_model(config, device, backend)
        return cls(model, backend, *kv_dims(hf_config))

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of the draft's cache (every layer, K and V)."""
        return kv_block_bytes(
            self.num_layers, block_size, self.num_kv_heads, self.head_dim, self.model.dtype
        )

    def runner(self, num_blocks: int, block_size: int, vocab_size: int) -> DraftRunner:
        """Allocates the draft's cache of `num_blocks` blocks (the target's count)."""
        shape = (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        device = next(self.model.parameters()).device
        cache = torch.zeros(shape, dtype=self.model.dtype, device=device)
        self.backend.bind_kv_cache(cache, None)
        return DraftRunner(self.model, self.backend, cache, block_size, vocab_size, device)


@dataclass(eq=False)
class DraftRunner:
    model: Any
    backend: AttentionBackend
    kv_cache: torch.Tensor
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]"""
    block_size: int
    vocab_size: int
    """The target's: proposals are ids below it."""
    device: torch.device
    inputs: InputBatch = field(init=False)

    def __post_init__(self) -> None:
        self.inputs = InputBatch(self.block_size, self.device)

    def run(
        self, states: list[SeqState], record: StepRecord, in_flight: torch.Tensor | None
    ) -> dict[int, list[int]]:
        """The draft's pass over the step's tokens (each verifying sequence's last token only),
        then the proposals of `record.propose`: sequence index -> its tokens."""
        propose = record.propose
        starts, qlens = [], []
        for i, (state, s, n) in enumerate(
            zip(states, record.starts, record.num_new_tokens, strict=True)
        ):
            # From the first position the draft's cache lacks: after a fully accepted proposal
            # that is the last proposed token, which the draft never took as an input.
            begin = s if state.draft_len is None else min(s, state.draft_len)
            starts.append(begin)
            qlens.append(n - propose.get(i, 0) + s - begin)
            state.draft_len = s + n - propose.get(i, 0)
        step = self.inputs.build(states, starts, qlens, record.block_tables, in_flight)
        self.backend.prepare(step.meta)
        hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)  # [T, H]
        if not propose:
            return {}
        order = sorted(propose)
        ends = list(itertools.accumulate(qlens))
        last = host_to_device([ends[i] - 1 for i in order], torch.int64, self.device)
        tokens = self._argmax(hidden.index_select(0, last))
        drafts = {i: [t] for i, t in zip(order, tokens, strict=True)}
        for j in range(1, max(propose.values())):
            active = [i for i in order if propose[i] > j]
            step = self.inputs.build(
                [states[i] for i in active],
                [record.starts[i] + j for i in active],
                [1] * len(active),
                [record.block_tables[i] for i in active],
                token_ids=[drafts[i][-1] for i in active],
            )
            self.backend.prepare(step.meta)
            hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)
            for i, t in zip(active, self._argmax(hidden), strict=True):
                drafts[i].append(t)
        for i in order:  # its inputs up to the last proposed token but one (`Verifier` trims)
            states[i].draft_len = record.starts[i] + propose[i]
        return drafts

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        logits = self.model.compute_logits(hidden)[:, : self.vocab_size]  # [rows, V] fp32
        ids: list[int] = logits.argmax(dim=-1).tolist()
        return ids
