"""The batch's token bitmask: built once per step on the host, applied in one op on the device.

Layout (xgrammar's): int32 [B, ceil(V / 32)]; bit b of word w allows token 32 * w + b. A row of
all ones (-1) leaves its logits untouched, so unconstrained rows share the batch's one op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr

_BITS = 32


def pack_allowed(allowed: torch.Tensor) -> torch.Tensor:
    """bool [V] -> int32 [ceil(V / 32)] in the layout above."""
    words = -(-allowed.numel() // _BITS)
    padded = torch.zeros(words * _BITS, dtype=torch.int64)
    padded[: allowed.numel()] = allowed.to(torch.int64)
    weights = torch.tensor([1 << b for b in range(_BITS)], dtype=torch.int64)
    packed = (padded.view(words, _BITS) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def fill_bitmask(
    matchers: list[xgr.GrammarMatcher | None],
    vocab_size: int,
    filters: list[torch.Tensor | None] | None = None,
) -> torch.Tensor | None:
    """[B, W] int32 on the host; None when no row is constrained.

    The same matcher may appear in several rows (a request's n samples before they fork): it is
    filled once and its row copied. `filters[i]`, when given, is a [W] mask ANDed into row i.
    """
    first_row: dict[int, int] = {}
    fill: list[xgr.GrammarMatcher] = []
    fill_rows: list[int] = []
    copies: list[tuple[int, int]] = []  # (dst row, src row)
    for i, m in enumerate(matchers):
        if m is None:
            continue
        src = first_row.get(id(m))
        if src is None:
            first_row[id(m)] = i
            fill.append(m)
            fill_rows.append(i)
        else:
            copies.append((i, src))
    if not fill:
        return None
    import xgrammar as xgr

    words = -(-vocab_size // _BITS)
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    if len(fill) == 1:
        fill[0].fill_next_token_bitmask(bitmask, fill_rows[0])
    else:
        xgr.BatchGrammarMatcher(max_threads=1).batch_fill_next_token_bitmask(
            fill, bitmask, indices=fill_rows
        )
    for dst, src in copies:
        bitmask[dst] = bitmask[src]
    for i, f in enumerate(filters or ()):
        if f is not None:
            bitmask[i] &= f[: bitmask.shape[1]]
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets the logits of disallowed tokens to -inf, in place, for the whole batch at once.

    logits: [B, V] float; bitmask: [B, W] int32 on logits.device with 32 * W >= V.
    """
    num_rows, vocab = logits.shape
    shifts = torch.arange(_BITS, dtype=torch.int32, device=logits.device)
    # allowed: [B, W, 32] -> [B, 32 * W] -> [B, V]
    allowed = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = allowed.view(num_rows, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
