"""Beam search's step on the device: the K best continuations of every beam group at once.

For each group g with running beams b (their logits rows) and cumulative logprobs s_b:
    score[b, t] = log_softmax(logits[b])[t] + s_b          (float32, as transformers adds them)
and the group's candidates are the top K of score over all (b, t), best first. All groups are
ranked in one padded batch ([G, W_max * V], padding rows at -inf) with one `topk`, and read back
with one host sync. The search's rules (which candidates finish, run on or end it) are the
engine core's (engine/core/beam.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

_NEG_INF = float("-inf")


@dataclass(slots=True)
class BeamRows:
    """One group's running beams in this step's logits."""

    rows: list[int]
    """Row of each beam in the logits, in the group's beam order."""
    scores: list[float]
    """Each beam's cumulative logprob."""
    k: int
    """Candidates to return."""
    banned: list[int] = field(default_factory=list)
    """Token ids no beam may take this step (min_tokens holds the finishing tokens back)."""


class BeamCandidate(NamedTuple):
    beam: int
    """Position of the parent beam in `BeamRows.rows`."""
    token_id: int
    cumulative_logprob: float


def top_candidates(
    logits: torch.Tensor, vocab_size: int, groups: list[BeamRows]
) -> list[list[BeamCandidate]]:
    """logits: [R, V'] (V' >= vocab_size); returns each group's K best candidates, best first."""
    if not groups:
        return []
    device = logits.device
    # lp: [R + 1, V] float32; the extra last row is all -inf (padding beams).
    lp = torch.log_softmax(logits[:, :vocab_size].to(torch.float32), dim=-1)
    lp = torch.cat([lp, lp.new_full((1, vocab_size), _NEG_INF)])
    ban_rows = [r for g in groups for r in g.rows for _ in g.banned]
    if ban_rows:
        ban_toks = [t for g in groups for _ in g.rows for t in g.banned]
        lp[torch.tensor(ban_rows, device=device), torch.tensor(ban_toks, device=device)] = _NEG_INF
    width = max(len(g.rows) for g in groups)
    pad = lp.shape[0] - 1
    index = [g.rows + [pad] * (width - len(g.rows)) for g in groups]
    scores = [g.scores + [0.0] * (width - len(g.scores)) for g in groups]
    idx = torch.tensor(index, dtype=torch.int64, device=device)  # [G, W]
    base = torch.tensor(scores, dtype=torch.float32, device=device)  # [G, W]
    acc = lp[idx] + base.unsqueeze(-1)  # [G, W, V]
    k = min(max(g.k for g in groups), width * vocab_size)
    vals, ids = acc.view(len(groups), width * vocab_size).topk(k, dim=-1)  # [G, K] best first
    host = torch.cat([vals.flatten().to(torch.float64), ids.flatten().to(torch.float64)]).tolist()
    n = len(groups) * k
    out = []
    for gi, g in enumerate(groups):
        cands = []
        for j in range(min(g.k, k)):
            v, flat = host[gi * k + j], int(host[n + gi * k + j])
            if v == _NEG_INF:
                break
            cands.append(BeamCandidate(flat // vocab_size, flat % vocab_size, v))
        out.append(cands)
    return out
