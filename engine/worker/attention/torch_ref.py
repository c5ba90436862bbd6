"""Reference attention in plain torch: batched over sequences, runs on CPU and CUDA.

Per layer: one `index_copy_` writes the new K/V by slot; then for each group of sequences, one
indexing op gathers their K/V through the block tables into a padded [S, max_seq_len, Hkv, D]
tensor and one attention call attends them all; one gather puts the rows back into the flat
[T, Hq, D] layout. Decode sequences (one new token) and prefill sequences (several) never share
a group, so a long prefill chunk does not pad every decode sequence to its length; and each kind
is split into up to MAX_GROUPS groups of similar length where that saves padded work
(`_length_buckets`).
The index tensors depend only on the metadata: they are built once per step (`prepare`) and
reused by every layer.

An fp8 cache (float8_e4m3fn) is written as K / scale and V / scale (saturated) and read back
through `dequantize_fp8` into the query dtype, with the layer's scales (`layer_scales`).

The attention call per group: a masked `scaled_dot_product_attention`, or plain causal SDPA (no
mask) when every sequence of the group is new and of one length (a cold prompt).
Sliding-window layers use the same gathered K/V with a windowed mask: one mask per distinct
window, built by the first layer of the step that uses it and reused by the others (like the
index tensors, per step, never per layer). Keys before a query's window may come from released
(placeholder) blocks: they are always masked. Logit soft-capping cannot go through SDPA: those
layers run two batched matmuls around a float32 softmax (transformers' eager attention).
NOTE: two batched matmuls around a float32 softmax (transformers' eager attention) ran the
decode group 2.2x faster than SDPA's flash kernel in isolation on the CPU in bf16, but made the
whole offline workload ~25% slower (alternated runs); SDPA stays.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.worker.attention.base import AttendOptions, AttentionBackend, AttentionMetadata
from engine.worker.attention.kv_quant import dequantize_fp8, is_fp8, quantize_fp8


@dataclass(slots=True)
class _SeqGroup:
    """Sequences attended by one SDPA call, padded to Q queries and L keys."""

    block_tables: torch.Tensor
    """[Sg, max_num_blocks] int64: the group's rows of meta.block_tables."""
    key_pos: torch.Tensor
    """[L] int64: key positions 0..L-1 (L = the group's longest sequence)."""
    query_index: torch.Tensor
    """[Sg, Q] int64: flat token of query j of each sequence (padding queries clamped)."""
    mask: torch.Tensor
    """[Sg, Q, L] bool: key p is visible to query j (empty for a causal group)."""
    query_pos: torch.Tensor
    """[Sg, Q] int64: position of query j (padding queries take their sequence's last one)."""
    seq_lens: torch.Tensor
    """[Sg] int64: each sequence's length (keys at positions >= it are padding)."""
    all_visible: bool
    """Every query sees every key (e.g. one decoding sequence): SDPA runs without a mask."""
    query_identity: bool
    """query_index is arange(T) (the group is the whole batch, Q queries each): no gather."""
    causal: bool
    """Every sequence has Q new tokens and no context (Q == L): plain causal attention, which
    SDPA runs without a mask and skipping the hidden half (1.3-1.6x faster from ~768 tokens)."""
    block_index_by_block_size: dict[int, torch.Tensor] = field(default_factory=dict)
    """block_size -> [Sg * C] int64: the first C = ceil(L / BS) block ids of each sequence."""
    masks_by_group: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)
    """(G, window) -> [Sg, 1, G * Q, L] additive float mask: `window_mask(window)` repeated for
    the G query heads of each KV head."""
    window_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    """window -> [Sg, Q, L] bool mask of the step (None: the causal `mask`, or one built from
    the positions for a causal group that needs an explicit mask)."""

    @property
    def max_len(self) -> int:
        return int(self.key_pos.shape[0])

    def effective_window(self, window: int | None) -> int | None:
        """None when the window hides nothing here (no query sees more than L keys)."""
        return None if window is None or window >= self.max_len else window

    def window_mask(self, window: int | None) -> torch.Tensor:
        """[Sg, Q, L] bool: key p visible to query j (p <= pos_j, p < seq_len, pos_j - p < W)."""
        mask = self.window_masks.get(window)
        if mask is None:
            if window is None and not self.causal:
                mask = self.mask
            else:
                keys = self.key_pos[None, None, :]  # [1, 1, L]
                pos = self.query_pos[:, :, None]  # [Sg, Q, 1]
                mask = (keys <= pos) & (keys < self.seq_lens[:, None, None])
                if window is not None:
                    mask &= keys > pos - window
            self.window_masks[window] = mask
        return mask

    def block_index(self, block_size: int) -> torch.Tensor:
        idx = self.block_index_by_block_size.get(block_size)
        if idx is None:
            # Columns past a sequence's own blocks hold padding ids (0): their keys are at
            # positions >= seq_len and masked out.
            cols = -(-self.key_pos.shape[0] // block_size)
            idx = self.block_tables[:, :cols].reshape(-1)
            self.block_index_by_block_size[block_size] = idx
        return idx

    def group_mask(
        self, group: int, dtype: torch.dtype, window: int | None = None
    ) -> torch.Tensor | None:
        """[Sg, 1, G * Q, L] additive mask (0 visible, -inf hidden) in the query dtype; None when
        every key is visible. `window`: an effective sliding window (see `effective_window`).

        NOTE: SDPA turns a boolean mask into an additive one on every call; building it once
        per step saves that conversion in every layer.
        """
        if self.all_visible and window is None:
            return None
        mask = self.masks_by_group.get((group, window))
        if mask is None or mask.dtype != dtype:
            visible = self.window_mask(window).repeat(1, group, 1).unsqueeze(1)
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            mask.masked_fill_(~visible, float("-inf"))
            self.masks_by_group[(group, window)] = mask
        return mask


@dataclass(slots=True)
class _StepPlan:
    """Index tensors of one step, shared by all layers."""

    meta: AttentionMetadata
    """The metadata this plan was built from (kept alive so its id cannot be reused)."""
    tensors: tuple[torch.Tensor, ...]
    """meta's tensors at build time; a plan is stale if any of them was replaced."""
    write_tokens: torch.Tensor | None
    """[W] int64: tokens with a non-negative slot; None when every token has one."""
    write_slots: torch.Tensor
    """[W] int64: their slots."""
    groups: list[_SeqGroup]
    """Decode group first (if any), then prefill group (if any)."""
    token_row: torch.Tensor | None
    """[T] int64: row of each flat token in the groups' concatenated [sum Sg * Q] outputs;
    None when that is the identity."""
    token_valid: torch.Tensor | None
    """[T, 1, 1] bool: False for padding tokens past the last query; None when there are none."""


class TorchAttentionBackend(AttentionBackend):
    """Batched paged attention with torch ops.

    `prepare(meta)` builds the step's index tensors; the runner calls it once per step, after the
    metadata is final. Without it, `forward` builds them on the first layer and reuses them for
    later layers given the same metadata object. NOTE: a runner that edits metadata tensors in
    place (persistent buffers) must call `prepare` after every edit.
    """

    name = "torch"
    supports_fp8_kv = True

    def __init__(self) -> None:
        self._plan: _StepPlan | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        """Builds and caches the gather/mask/scatter indices of one step."""
        self._plan = _build_plan(meta)

    def _plan_for(self, meta: AttentionMetadata) -> _StepPlan:
        plan = self._plan
        if plan is None or plan.meta is not meta or not _same(plan.tensors, _meta_tensors(meta)):
            plan = _build_plan(meta)
            self._plan = plan
        return plan

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        plan = self._plan_for(meta)
        # cache: [2, NB * BS, Hkv, D] view of this layer's K and V
        cache = kv_cache.view(2, -1, num_kv_heads, head_dim)
        scales = self.layer_scales(kv_cache) if is_fp8(kv_cache) else None
        for i, new in enumerate((k, v)):  # [T, Hkv, D] each
            if plan.write_tokens is not None:
                new = new[plan.write_tokens]  # [W, Hkv, D]
            if scales is None:
                cache[i].index_copy_(0, plan.write_slots, new.to(cache.dtype))
            else:
                # NOTE: torch has no float8 index_copy_ on the CPU; the bytes are the same.
                codes = quantize_fp8(new, scales[i]).view(torch.uint8)
                cache[i].view(torch.uint8).index_copy_(0, plan.write_slots, codes)

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, opts: AttendOptions
    ) -> torch.Tensor:
        scale, sliding_window, logits_soft_cap = opts
        plan = self._plan_for(meta)
        kv_scales = self.layer_scales(kv_cache) if is_fp8(kv_cache) else None
        rows = [
            _attend(
                q,
                kv_cache,
                g,
                scale,
                g.effective_window(sliding_window),
                logits_soft_cap,
                kv_scales,
            )
            for g in plan.groups
        ]
        out = rows[0] if len(rows) == 1 else torch.cat(rows)  # [sum Sg * Q, Hq, D]
        if plan.token_row is not None:
            out = out[plan.token_row]  # [T, Hq, D]
        if plan.token_valid is not None:
            out = out * plan.token_valid
        return out


def _attend(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    group: _SeqGroup,
    scale: float,
    window: int | None,
    soft_cap: float | None,
    kv_scales: tuple[float, float] | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; kv_cache: [2, NB, BS, Hkv, D] -> [Sg * Q, Hq, D] rows (sequence-major).

    window: an effective sliding window (None: none that hides a key of this group).
    kv_scales: the layer's (K, V) scales of an fp8 cache; None for a cache in a float type. K and
    V are dequantized before the scores, so the soft cap sees the true q . k * scale."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    g = num_q_heads // num_kv_heads
    num_seqs, max_q = group.query_index.shape
    max_len = group.key_pos.shape[0]
    # Gather whole blocks (contiguous BS * Hkv * D runs), not single slots: one index_select
    # per K and V. [Sg * C, BS, Hkv, D] -> [Sg, C * BS, Hkv, D] -> first L positions.
    idx = group.block_index(block_size)
    k, v = (
        _to_query_dtype(
            kv_cache[i]
            .index_select(0, idx)
            .view(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len],
            q.dtype,
            None if kv_scales is None else kv_scales[i],
        ).transpose(1, 2)  # [Sg, Hkv, L, D]
        for i in (0, 1)
    )
    # [Sg, Q, Hq, D]
    queries = (
        q.view(num_seqs, max_q, *q.shape[1:]) if group.query_identity else q[group.query_index]
    )
    if group.causal and window is None and soft_cap is None:
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), k, v, is_causal=True, scale=scale, enable_gqa=True
        )  # [Sg, Hq, Q, D]
        return out.transpose(1, 2).reshape(num_seqs * max_q, num_q_heads, head_dim)
    # fold the G query heads of each KV head into the query axis: [Sg, Hkv, G * Q, D]
    queries = (
        queries.view(num_seqs, max_q, num_kv_heads, g, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(num_seqs, num_kv_heads, g * max_q, head_dim)
    )
    mask = group.group_mask(g, queries.dtype, window)  # [Sg, 1, G * Q, L] or None
    if soft_cap is None:
        out = F.scaled_dot_product_attention(
            queries, k, v, attn_mask=mask, scale=scale
        )  # [Sg, Hkv, G * Q, D]
    else:
        scores = torch.matmul(queries, k.transpose(2, 3)) * scale  # [Sg, Hkv, G * Q, L]
        scores = torch.tanh(scores / soft_cap) * soft_cap
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        out = torch.matmul(probs, v)  # [Sg, Hkv, G * Q, D]
    return (
        out.view(num_seqs, num_kv_heads, g, max_q, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(num_seqs * max_q, num_q_heads, head_dim)
    )


def _to_query_dtype(x: torch.Tensor, dtype: torch.dtype, kv_scale: float | None) -> torch.Tensor:
    """Gathered K or V [Sg, L, Hkv, D] in the query dtype (fp8: dequantized with kv_scale)."""
    return x.to(dtype) if kv_scale is None else dequantize_fp8(x, dtype, kv_scale)


def _meta_tensors(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    return (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables)


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(x is y for x, y in zip(a, b, strict=True))


def _build_group(
    meta: AttentionMetadata, seqs: list[int], starts: list[int], num_tokens: int
) -> _SeqGroup:
    """Index tensors for the sequences `seqs` (indices into the batch).

    NOTE: built with numpy from the host copies of the lengths, then moved once each: a dozen
    small torch ops per step cost more than the decode step's attention on a small model.
    """
    device = meta.slot_mapping.device
    query_lens = [meta.query_lens_cpu[i] for i in seqs]
    seq_lens = [meta.seq_lens_cpu[i] for i in seqs]
    max_q = max(max(query_lens), 1)
    max_len = max(max(seq_lens), 1)
    if seqs == list(range(meta.num_seqs)):
        block_tables = meta.block_tables.to(torch.int64)
    else:
        seq_index = torch.tensor(seqs, dtype=torch.int64, device=device)
        block_tables = meta.block_tables[seq_index].to(torch.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)  # [Sg]
    contexts = lens - np.asarray(query_lens, dtype=np.int64)  # [Sg]
    first = np.asarray([starts[i] for i in seqs], dtype=np.int64)  # [Sg]
    key_pos = np.arange(max_len)  # [L]
    q_pos = np.arange(max_q)  # [Q]
    query_index = np.minimum(first[:, None] + q_pos[None, :], max(num_tokens - 1, 0))
    # Query j of a sequence sits at position context_len + j; it sees keys p <= that position
    # and p < seq_len. Padding queries (j >= query_len) see all of the sequence's keys, so no row
    # is fully masked (which would give NaN).
    causal = max_q > 1 and all(q == max_q for q in query_lens) and int(contexts.max()) == 0
    qlens = np.asarray(query_lens, dtype=np.int64)  # [Sg]
    query_pos = contexts[:, None] + np.minimum(q_pos[None, :], np.maximum(qlens - 1, 0)[:, None])
    if causal:
        mask = np.zeros((0, 0, 0), dtype=bool)  # SDPA's is_causal does the masking
    else:
        query_abs = contexts[:, None] + q_pos[None, :]  # [Sg, Q]
        mask = (key_pos[None, None, :] <= query_abs[:, :, None]) & (
            key_pos[None, None, :] < lens[:, None, None]
        )  # [Sg, Q, L]
    # NOTE: the host already knows both facts; no device sync.
    all_visible = all(q == 1 for q in query_lens) and min(seq_lens) == max_len
    query_identity = (
        seqs == list(range(len(seqs)))
        and all(q == max_q for q in query_lens)
        and len(seqs) * max_q == num_tokens
    )
    return _SeqGroup(
        block_tables,
        torch.from_numpy(key_pos).to(device),
        torch.from_numpy(query_index).to(device),
        torch.from_numpy(mask).to(device),
        torch.from_numpy(query_pos).to(device),
        torch.from_numpy(lens).to(device),
        all_visible,
        query_identity,
        causal,
    )


MAX_GROUPS = 4
"""Decoding sequences, and prefilling ones, are each attended in at most this many groups."""
SPLIT_COST = 32768
"""What one more SDPA call costs, in (query x padded key) pairs per KV head: a split must save
more (~50 us of a CPU call's overhead at this model size)."""


def _length_buckets(seqs: list[int], query_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Splits sequences into groups of similar length; one group, in batch order, when that is
    best.

    NOTE: a group's SDPA costs about sequences x longest query x longest sequence: every
    sequence is padded to the group's longest. Sorted by length, a group is split where that
    cuts the padded work by more than SPLIT_COST, greedily, into at most MAX_GROUPS groups. A
    prefill chunk of several new prompts of 32-512 tokens did ~3x the attention work it needed
    in one padded group.
    """
    if len(seqs) < 2:
        return [seqs]
    order = sorted(seqs, key=lambda i: (seq_lens[i], query_lens[i]))
    lens = np.asarray([seq_lens[i] for i in order], dtype=np.int64)  # ascending
    qlens = np.asarray([query_lens[i] for i in order], dtype=np.int64)
    bounds = [0, len(order)]
    while len(bounds) - 1 < MAX_GROUPS:
        best_gain, best_cut = 0, 0
        for lo, hi in itertools.pairwise(bounds):
            if hi - lo < 2:
                continue
            q = qlens[lo:hi]
            left_q = np.maximum.accumulate(q)[:-1]  # longest query of [lo, cut)
            right_q = np.maximum.accumulate(q[::-1])[::-1][1:]  # ... of [cut, hi)
            cuts = np.arange(lo + 1, hi)  # the new group starts at each cut
            split = (cuts - lo) * left_q * lens[cuts - 1] + (hi - cuts) * right_q * lens[hi - 1]
            gain = (hi - lo) * int(q.max()) * int(lens[hi - 1]) - split
            k = int(gain.argmax())
            if gain[k] > best_gain:
                best_gain, best_cut = int(gain[k]), int(cuts[k])
        if best_gain <= SPLIT_COST:
            break
        bounds = sorted([*bounds, best_cut])
    if len(bounds) == 2:
        return [seqs]
    return [order[lo:hi] for lo, hi in itertools.pairwise(bounds)]


def _build_plan(meta: AttentionMetadata) -> _StepPlan:
    device = meta.slot_mapping.device
    slot_mapping = meta.slot_mapping.to(torch.int64)
    num_tokens = slot_mapping.shape[0]
    query_lens = meta.query_lens_cpu
    num_queries = sum(query_lens)

    # NOTE: one host sync per step to drop padding slots (index_copy_ cannot skip entries).
    write_tokens: torch.Tensor | None = None
    write_slots = slot_mapping
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        write_tokens = valid.nonzero().squeeze(1)
        write_slots = slot_mapping[write_tokens]

    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    decode_groups = _length_buckets(
        [i for i, n in enumerate(query_lens) if n == 1], query_lens, meta.seq_lens_cpu
    )
    prefill_groups = _length_buckets(
        [i for i, n in enumerate(query_lens) if n != 1], query_lens, meta.seq_lens_cpu
    )
    group_seqs = [seqs for seqs in (*decode_groups, *prefill_groups) if seqs]
    groups = [_build_group(meta, seqs, starts, num_tokens) for seqs in group_seqs]

    # row_base[i]: row of sequence i's first query in the concatenated group outputs, where
    # each group holds Sg x Qg rows (its sequences, each padded to its longest query).
    row_base = [0] * len(query_lens)
    total_rows = 0
    for seqs, group in zip(group_seqs, groups, strict=True):
        max_q = group.query_index.shape[1]
        for rank, i in enumerate(seqs):
            row_base[i] = total_rows + rank * max_q
        total_rows += len(seqs) * max_q

    token_row: torch.Tensor | None = None
    identity = total_rows == num_queries and row_base == starts[:-1]
    if not identity or num_tokens != num_queries:
        tokens = np.arange(num_tokens)  # [T]
        starts_np = np.asarray(starts, dtype=np.int64)  # [S + 1]
        seq_of = np.clip(np.searchsorted(starts_np, tokens, side="right") - 1, 0, len(starts) - 2)
        base = np.asarray(row_base, dtype=np.int64)  # [S]
        rows = np.clip(base[seq_of] + tokens - starts_np[seq_of], 0, total_rows - 1)
        token_row = torch.from_numpy(rows).to(device)
    token_valid: torch.Tensor | None = None
    if num_queries < num_tokens:
        token_valid = (
            torch.from_numpy(np.arange(num_tokens) < num_queries).to(device).view(-1, 1, 1)
        )
    return _StepPlan(
        meta=meta,
        tensors=_meta_tensors(meta),
        write_tokens=write_tokens,
        write_slots=write_slots,
        groups=groups,
        token_row=token_row,
        token_valid=token_valid,
    )
