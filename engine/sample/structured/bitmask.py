"""The batch's token mask: packed bits from the grammar matchers, applied to the logits in one op.

Layout (xgrammar's): int32 [R, ceil(V / 32)]; bit b of word w allows token 32 * w + b. Only the
R constrained rows of a batch get a row; `TokenMask.rows` says which logits rows they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_BITS = 32


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // _BITS)


def pack_allowed(allowed: np.ndarray | torch.Tensor) -> np.ndarray:
    """bool [V] -> int32 [ceil(V / 32)] in the layout above (padding bits clear)."""
    flags = np.asarray(allowed, dtype=bool)
    padded = np.zeros(bitmask_words(flags.size) * _BITS, dtype=bool)
    padded[: flags.size] = flags
    return np.packbits(padded, bitorder="little").view(np.int32)


def unpack_banned(packed: np.ndarray) -> np.ndarray:
    """int32 [R, W] -> uint8 [R, 32 * W], 1 where a token is NOT allowed (numpy only: safe off
    the step thread). Byte k of a little-endian word holds tokens 8k..8k+7, so unpacking the bytes
    little-endian bit first gives token order."""
    return np.unpackbits(np.invert(packed).view(np.uint8), axis=1, bitorder="little")


@dataclass(frozen=True, slots=True)
class TokenMask:
    """The tokens each constrained row of a batch may take (one step)."""

    rows: torch.Tensor | None
    """int64 [R] logits rows to mask, ascending; None when every row of the batch is masked."""
    packed: torch.Tensor
    """int32 [R, W] allowed bits (host memory)."""
    banned: torch.Tensor | None
    """bool [R, >= V] True where a token is not allowed, unpacked on the host; None to unpack on
    the logits' device instead (a GPU: it moves 32x fewer bytes)."""

    @classmethod
    def from_bitmask(cls, bitmask: torch.Tensor) -> TokenMask:
        """A mask over every row of a batch from a packed int32 [B, W] bitmask."""
        return cls(rows=None, packed=bitmask, banned=None)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Sets the logits of disallowed tokens to -inf, in place, in one op over the masked rows.

    logits: [B, V] float with 32 * W >= V.
    """
    vocab = logits.shape[1]
    if mask.banned is not None and logits.device.type == "cpu":
        banned = mask.banned[:, :vocab]
    else:
        packed = mask.packed.to(logits.device, non_blocking=True)
        shifts = torch.arange(_BITS, dtype=torch.int32, device=logits.device)
        # allowed bits: [R, W, 32] -> [R, 32 * W] -> [R, V]
        bits = (packed.unsqueeze(-1) >> shifts) & 1
        banned = bits.view(packed.shape[0], -1)[:, :vocab] == 0
    if mask.rows is None:
        logits.masked_fill_(banned, float("-inf"))
        return
    rows = mask.rows.to(logits.device, non_blocking=True)
    sub = logits.index_select(0, rows).masked_fill_(banned, float("-inf"))
    logits.index_copy_(0, rows, sub)
