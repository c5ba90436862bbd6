"""The bounded subset of a prompt's block-hash chain that the affinity store records."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from engine.kv.hashing import BlockHash

TierBlocks = tuple[int, int, int, int]
"""Leading blocks of a prompt held, by tier: (device, cpu, disk, remote)."""
REMOTE_HOLDER = "@remote"
"""The holder of the remote tier's records: the tier shared by every replica of a model is
recorded as a replica of its own (each replica's agent writes what it stored there), so its
records outlive the replica that wrote the blocks; the router credits them to every replica
(service/router/servicer.py)."""


def bounded_chain(block_hashes: Sequence[BlockHash], limit: int) -> list[BlockHash]:
    """At most `limit` hashes of a chain: all of them, or the first `limit - 1` and the last.

    Hashes are chained, so the last hash alone stands for the whole prompt and the leading ones
    for the shared prefixes (system prompts) other sessions are likely to reuse.
    """
    if len(block_hashes) <= limit:
        return list(block_hashes)
    if limit == 1:
        return [block_hashes[-1]]
    return [*block_hashes[: limit - 1], block_hashes[-1]]


def leading_tiers(held: Sequence[Mapping[str, int]]) -> dict[str, TierBlocks]:
    """`held[i]`: replica id -> tier index (0 device, 1 cpu, 2 disk, 3 remote) of its record of
    block i.

    Each replica's leading blocks, up to its deepest record, counted by tier; a block without a
    record takes the tier of the next deeper one (see service/affinity/base.py).
    """
    counts: dict[str, list[int]] = {}
    current: dict[str, int] = {}
    for i in range(len(held) - 1, -1, -1):
        current.update(held[i])
        for rid, t in current.items():
            counts.setdefault(rid, [0, 0, 0, 0])[t] += 1
    return {rid: (c[0], c[1], c[2], c[3]) for rid, c in counts.items()}


def with_shared_tier(
    held: Mapping[str, TierBlocks], replica_ids: Iterable[str]
) -> dict[str, TierBlocks]:
    """`held` (a store's `longest_prefix_tiers`) for `replica_ids`, each with the remote tier's
    leading run (the records of REMOTE_HOLDER, the tier every replica shares) past what the
    replica holds itself; a replica with neither is absent."""
    shared = sum(held.get(REMOTE_HOLDER, ()))
    out: dict[str, TierBlocks] = {}
    for rid in replica_ids:
        t = held.get(rid)
        if shared:
            d, c, k, r = t or (0, 0, 0, 0)
            t = (d, c, k, max(r, shared - d - c - k))
        if t is not None:
            out[rid] = t
    return out
