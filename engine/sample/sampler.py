"""Vectorized sampling over a batch of logits rows (vLLM's semantics).

Order of operations on the [B, V] logits:
    0. Structured outputs: the batch's token mask (engine/sample/structured/bitmask.py) sets the tokens
       each constrained row's grammar forbids to -inf, in one op over the constrained rows.
    1. min_tokens: while a row has fewer than `min_tokens` outputs, its stop_token_ids and (unless
       ignore_eos) the EOS ids are set to -inf. The grammar wins over min_tokens: a constrained
       row left with no token (its output is complete and the grammar allows only its end) keeps
       those tokens, so the sample ends there, valid, with fewer than min_tokens.
    2. Penalties: repetition (prompt + output tokens; positive logits divided, negative multiplied),
       then frequency and presence (output tokens only; subtracted).
    3. Logprobs are taken here: log_softmax of the logits after steps 0-2, before temperature,
       min_p, top-k and top-p (vLLM's "processed logits" before the sampling transforms). So a
       grammar's or min_tokens' masked tokens have probability 0: they never appear among the top
       alternatives, which can then hold fewer than k entries (vLLM's default, raw logprobs
       before any processing, would list tokens that cannot be sampled).
    4. Greedy rows (temperature 0) take the argmax.
    5. Other rows: divide by temperature, min_p, then top-k and top-p, softmax, and sample with
       the exponential race argmax(probs / q), q ~ Exponential(1). Unseeded rows draw q from the
       sampler's shared generator (one draw for the batch); a seeded row draws from its own
       generator, so its tokens do not depend on the rest of the batch.
Every step is skipped when no row uses it. `sample` ends with the results' non-blocking copy to
the host; `SampledBatch.to_host` is the one host sync (the engine may schedule its next step first).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from engine.outputs import TokenLogprob
from engine.sample.sampling_params import SamplingParams
from engine.sample.structured.bitmask import TokenMask, apply_token_mask

_NEG_INF = float("-inf")


def host_to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device` without syncing the stream (vLLM's async_tensor_h2d).

    NOTE: `torch.tensor(values, device=cuda)` copies from pageable memory and waits for the
    stream's work to end: inside a step it would wait for the forward just launched, which async
    scheduling must not. A pinned source with a non-blocking copy queues behind it instead."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class OutputTokens(Sequence[int]):
    """A sequence's generated tokens as a view of its token list, without copying them.

    NOTE: the runner builds one per row per step; copying the output (`token_ids[prompt:]`) each
    step made a long generation quadratic, though only penalties and min_tokens read it.
    """

    __slots__ = ("_start", "_tokens")

    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self._tokens = token_ids
        self._start = num_prompt_tokens

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, None)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        return self._tokens[self._start :][i]


@dataclass(slots=True, eq=False)
class SamplingRow:
    """One row of logits to sample (one sequence). Compared by identity (see `_BatchTraits`)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: Sequence[int]
    """Tokens this sequence has generated so far (read by length and iteration only)."""
    generator: torch.Generator | None
    """The request's own generator (on the sampler's device); set only when params.seed is set."""
    # What the sampler asks of every row each step, read once from `params` (the runner keeps a
    # sample's row for its whole life, so these cost nothing per step).
    greedy: bool = field(init=False)
    wants_logprob: bool = field(init=False)
    min_tokens: int = field(init=False)
    rep_penalty: bool = field(init=False)
    """repetition_penalty != 1."""
    pf_penalty: bool = field(init=False)
    """A presence or frequency penalty."""

    def __post_init__(self) -> None:
        p = self.params
        self.greedy = p.greedy
        self.wants_logprob = p.wants_logprob
        self.min_tokens = p.min_tokens
        self.rep_penalty = p.repetition_penalty != 1.0
        self.pf_penalty = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclass(slots=True, frozen=True)
class _BatchTraits:
    """What a batch of rows asks of the sampler, read once per distinct list of rows: a decode
    step samples the same rows as the step before, so this costs no pass over them then."""

    all_greedy: bool
    min_tokens: bool
    """Some row has min_tokens (whether it still holds is checked per step)."""
    rep_penalty: bool
    pf_penalty: bool
    logprob_rows: list[int]
    """The rows whose chosen token's logprob is reported."""

    @staticmethod
    def of(rows: list[SamplingRow]) -> _BatchTraits:
        return _BatchTraits(
            all_greedy=all(r.greedy for r in rows),
            min_tokens=any(r.min_tokens for r in rows),
            rep_penalty=any(r.rep_penalty for r in rows),
            pf_penalty=any(r.pf_penalty for r in rows),
            logprob_rows=[i for i, r in enumerate(rows) if r.wants_logprob],
        )


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    """One sampled token per row."""
    logprobs: list[TokenLogprob | None]
    """Per row; None where neither logprobs nor best_of's ranking asks for them."""


@dataclass(slots=True, eq=False)
class SampledBatch:
    """A batch sampled on the device whose results are on their way to the host (vLLM's
    AsyncModelRunnerOutput idea): `token_ids` stays on the device (the next step's inputs can
    gather from it), and everything the host needs travels in one packed tensor with a
    non-blocking copy; `to_host` waits for it (an event on CUDA) and unpacks it."""

    token_ids: torch.Tensor
    """[B] int64 on the sampler's device."""
    rows: list[SamplingRow]
    lp_rows: list[int]
    """The rows whose chosen token's logprob is reported."""
    max_top: int
    """Top alternatives packed per logprob row."""
    vocab_size: int
    packed: torch.Tensor
    """On the host (pinned on CUDA) once `ready` fires: the token ids (int64) when no row wants
    logprobs, else float64 [ids, chosen logprobs, top ids, top values]."""
    ready: torch.cuda.Event | None = None
    """Recorded after the copy into `packed` (CUDA); None: already on the host."""

    def to_host(self) -> SamplerOutput:
        """Waits for the copy (the step's one host sync) and unpacks it into host lists."""
        if self.ready is not None:
            self.ready.synchronize()
        host = self.packed.tolist()
        num_rows = len(self.rows)
        if not self.lp_rows:
            return SamplerOutput(host, [None] * num_rows)
        tokens = [int(t) for t in host[:num_rows]]
        out_logprobs: list[TokenLogprob | None] = [None] * num_rows
        lp_rows, max_top = self.lp_rows, self.max_top
        num_lp = len(lp_rows)
        chosen_lp = host[num_rows : num_rows + num_lp]
        ids_start = num_rows + num_lp
        vals_start = ids_start + num_lp * max_top
        for j, i in enumerate(lp_rows):
            k = min(self.rows[i].params.logprobs or 0, self.vocab_size)
            ids = host[ids_start + j * max_top : ids_start + j * max_top + k]
            vals = host[vals_start + j * max_top : vals_start + j * max_top + k]
            out_logprobs[i] = TokenLogprob(
                token_id=tokens[i],
                logprob=chosen_lp[j],
                top=[(int(t), v) for t, v in zip(ids, vals, strict=True) if v != _NEG_INF],
            )
        return SamplerOutput(token_ids=tokens, logprobs=out_logprobs)


class Sampler:
    """Samples one token per row; see the module docstring for the order of operations."""

    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        """Shared by every row without its own seed."""
        self.generator.manual_seed(seed)
        self._traits: tuple[list[SamplingRow], _BatchTraits] | None = None
        """The last batch's rows and their traits."""

    def _batch_traits(self, rows: list[SamplingRow]) -> _BatchTraits:
        last = self._traits
        # rows compare by identity: one C-level pass, no attribute reads
        if last is not None and last[0] == rows:
            return last[1]
        traits = _BatchTraits.of(rows)
        self._traits = (list(rows), traits)
        return traits

    def needs_history(self, rows: list[SamplingRow]) -> bool:
        """Whether some row's sampling reads its output so far (min_tokens, penalties): such a
        step cannot be sampled before the previous step's tokens are on the host."""
        traits = self._batch_traits(rows)
        return traits.min_tokens or traits.rep_penalty or traits.pf_penalty

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        eos_token_ids: Sequence[int],
        mask: TokenMask | None = None,
    ) -> SamplerOutput:
        """`sample`, then its results on the host."""
        return self.sample(logits, rows, eos_token_ids, mask).to_host()

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        eos_token_ids: Sequence[int],
        mask: TokenMask | None = None,
    ) -> SampledBatch:
        """Samples on the device and starts the results' copy to the host; no host sync.

        logits: [B, V'] with V' >= vocab_size (padding columns are dropped); B == len(rows).
        mask: the tokens the constrained rows may take (structured outputs), or None.
        """
        num_rows = len(rows)
        if num_rows == 0:
            return self._packed(torch.zeros(0, dtype=torch.int64, device=self.device), rows)
        if logits.shape[0] != num_rows:
            raise ValueError(f"got {logits.shape[0]} logits rows for {num_rows} sampling rows")
        traits = self._batch_traits(rows)
        logits = logits[:, : self.vocab_size]
        if (
            traits.all_greedy
            and not traits.logprob_rows
            and mask is None
            and not (traits.min_tokens or traits.rep_penalty or traits.pf_penalty)
        ):  # nothing changes the logits: their argmax is the answer
            return self._packed(logits.argmax(dim=-1), rows)
        # logits: [B, V] float32, our own copy (modified in place below)
        logits = logits.to(dtype=torch.float32, copy=True)
        if mask is not None:
            apply_token_mask(logits, mask)

        if traits.min_tokens:
            self._apply_min_tokens(logits, rows, eos_token_ids)
        if traits.rep_penalty or traits.pf_penalty:
            logits = self._apply_penalties(logits, rows)

        # Logprobs of the rows that asked for them: [L, V]
        lp_rows = traits.logprob_rows
        logprobs: torch.Tensor | None = None
        lp_index: torch.Tensor | None = None
        if lp_rows:
            lp_index = host_to_device(lp_rows, torch.int64, self.device)  # [L]
            logprobs = torch.log_softmax(logits.index_select(0, lp_index), dim=-1)

        if traits.all_greedy:
            token_ids = logits.argmax(dim=-1)  # [B] int64
        else:
            token_ids = self._sample(logits, rows)
        if logprobs is None or lp_index is None:
            return self._packed(token_ids, rows)
        # Everything the host needs, packed into one float64 tensor for a single transfer
        # (token ids < 2**53 are exact in float64).
        parts = [token_ids.to(torch.float64)]
        chosen = logprobs.gather(1, token_ids.index_select(0, lp_index).unsqueeze(1))  # [L, 1]
        parts.append(chosen.squeeze(1).to(torch.float64))
        max_top = min(max(rows[i].params.logprobs or 0 for i in lp_rows), self.vocab_size)
        if max_top > 0:
            top_vals, top_ids = logprobs.topk(max_top, dim=-1)  # [L, K], best first
            parts.append(top_ids.flatten().to(torch.float64))
            parts.append(top_vals.flatten().to(torch.float64))
        return self._packed(token_ids, rows, torch.cat(parts), lp_rows, max_top)

    def _packed(
        self,
        token_ids: torch.Tensor,
        rows: list[SamplingRow],
        packed: torch.Tensor | None = None,
        lp_rows: list[int] | None = None,
        max_top: int = 0,
    ) -> SampledBatch:
        """Starts the packed results' copy to the host (pinned, non-blocking, with an event on
        CUDA; nothing to copy on the CPU)."""
        packed = token_ids if packed is None else packed
        ready = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            packed = host
        return SampledBatch(token_ids, rows, lp_rows or [], max_top, self.vocab_size, packed, ready)

    def _apply_min_tokens(
        self, logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: Sequence[int]
    ) -> None:
        row_idx: list[int] = []
        tok_idx: list[int] = []
        for i, r in enumerate(rows):
            if not r.min_tokens or len(r.output_token_ids) >= r.min_tokens:
                continue
            banned = set(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                banned.update(eos_token_ids)
            banned = {t for t in banned if 0 <= t < self.vocab_size}
            row_idx.extend([i] * len(banned))
            tok_idx.extend(banned)
        if not row_idx:
            return
        index = host_to_device([row_idx, tok_idx], torch.int64, self.device)  # [2, N]
        constrained = sorted({i for i in row_idx if rows[i].params.response_format is not None})
        if not constrained:
            logits[index[0], index[1]] = _NEG_INF
            return
        kept = logits[index[0], index[1]]  # [N]
        logits[index[0], index[1]] = _NEG_INF
        check = host_to_device(constrained, torch.int64, self.device)
        stuck = torch.zeros(len(rows), dtype=torch.bool, device=self.device)  # [B]
        stuck[check] = torch.isneginf(logits.index_select(0, check)).all(dim=-1)
        logits[index[0], index[1]] = torch.where(stuck[index[0]], kept, _NEG_INF)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        num_rows, vocab = logits.shape
        rep_rows = [i for i, r in enumerate(rows) if r.rep_penalty]
        if rep_rows:
            # NOTE: the flat index is rebuilt from the token lists every call: O(prompt + output)
            # host work per penalized row and step.
            flat = self._flat_index(rows, rep_rows, vocab, with_prompt=True)
            seen = torch.zeros(num_rows * vocab, dtype=torch.bool, device=self.device)
            seen[flat] = True
            rep = self._row_values(rows, lambda p: p.repetition_penalty)  # [B, 1]
            penalized = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen.view(num_rows, vocab), penalized, logits)

        pf_rows = [i for i, r in enumerate(rows) if r.pf_penalty]
        if pf_rows:
            flat = self._flat_index(rows, pf_rows, vocab, with_prompt=False)
            counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=self.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
            counts = counts.view(num_rows, vocab)  # [B, V] occurrences in the output
            freq = self._row_values(rows, lambda p: p.frequency_penalty)  # [B, 1]
            pres = self._row_values(rows, lambda p: p.presence_penalty)  # [B, 1]
            logits = logits - freq * counts - pres * (counts > 0).to(torch.float32)
        return logits

    def _flat_index(
        self, rows: list[SamplingRow], which: list[int], vocab: int, *, with_prompt: bool
    ) -> torch.Tensor:
        """[N] int64 indices row * vocab + token over the chosen rows' tokens."""
        flat: list[int] = []
        for i in which:
            base = i * vocab
            if with_prompt:
                flat.extend(base + t for t in rows[i].prompt_token_ids if 0 <= t < vocab)
            flat.extend(base + t for t in rows[i].output_token_ids if 0 <= t < vocab)
        return host_to_device(flat, torch.int64, self.device)

    def _row_values(
        self, rows: list[SamplingRow], get: Callable[[SamplingParams], float]
    ) -> torch.Tensor:
        """[B, 1] float32 of one parameter per row."""
        values = [float(get(r.params)) for r in rows]
        return host_to_device(values, torch.float32, self.device).unsqueeze(1)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[B] int64 token ids (greedy rows: the argmax)."""
        greedy_ids = logits.argmax(dim=-1)  # [B]
        vocab = logits.shape[1]

        # Greedy rows run through the random path with temperature 1; their result is discarded.
        temps = self._row_values(rows, lambda p: p.temperature if p.temperature > 0 else 1.0)
        logits = logits / temps

        if any(r.params.min_p > 0.0 for r in rows):
            min_p = self._row_values(rows, lambda p: p.min_p)  # [B, 1]
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p  # [B, 1]
            logits = logits.masked_fill(probs < threshold, _NEG_INF)

        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
        use_top_p = any(r.params.top_p < 1.0 for r in rows)
        if use_top_p:
            logits = self._top_k_top_p(logits, rows, top_k)
        elif any(top_k):
            logits = self._top_k(logits, top_k)

        probs = logits.softmax(dim=-1)  # [B, V]
        # Exponential race: argmax(probs / q), q ~ Exp(1), draws token t with probability probs[t].
        seeded = [i for i, r in enumerate(rows) if r.generator is not None and not r.params.greedy]
        if len(seeded) < sum(not r.params.greedy for r in rows):
            q = torch.empty_like(probs).exponential_(generator=self.generator)
        else:
            q = torch.ones_like(probs)
        for i in seeded:
            q[i].exponential_(generator=rows[i].generator)
        q.clamp_(min=torch.finfo(torch.float32).tiny)
        random_ids = (probs / q).argmax(dim=-1)  # [B]

        greedy = host_to_device([r.params.greedy for r in rows], torch.bool, self.device)
        return torch.where(greedy, greedy_ids, random_ids)

    def _top_k(self, logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
        """Keeps each row's k best logits (ties with the k-th included); k = 0 keeps all."""
        k = host_to_device(top_k, torch.int64, self.device).unsqueeze(1)  # [B, 1]
        best = logits.topk(max(top_k), dim=-1).values  # [B, max_k], descending
        kth = best.gather(1, (k - 1).clamp(min=0))  # [B, 1]
        kth = kth.masked_fill(k == 0, _NEG_INF)
        return logits.masked_fill(logits < kth, _NEG_INF)

    def _top_k_top_p(
        self, logits: torch.Tensor, rows: list[SamplingRow], top_k: list[int]
    ) -> torch.Tensor:
        """Top-k then top-p with one ascending sort."""
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1)  # [B, V] ascending
        if any(top_k):
            keep = host_to_device([k if k else vocab for k in top_k], torch.int64, self.device)
            kth = sorted_logits.gather(1, (vocab - keep).unsqueeze(1))  # [B, 1]
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
        top_p = self._row_values(rows, lambda p: p.top_p)  # [B, 1]
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
        # Drop the low tail whose mass is <= 1 - p; the best token always stays.
        drop = cum <= 1.0 - top_p
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
