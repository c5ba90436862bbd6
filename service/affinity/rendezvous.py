"""Rendezvous (highest random weight) hashing: the routing used while the store is unreachable.

Every router ranks the replicas for a key the same way, without shared state; when a replica
leaves, only the keys it ranked first move, and they spread over the others.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def _weight(key: str, node: str) -> int:
    digest = hashlib.blake2b(
        key.encode() + b"\x00" + node.encode(), digest_size=8, person=b"deja-hrw"
    ).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, nodes: Iterable[str]) -> list[str]:
    """`nodes` ranked for `key`, best first (ties, which need a hash collision, by node name)."""
    return sorted(nodes, key=lambda n: (-_weight(key, n), n))


def rendezvous_pick(key: str, nodes: Iterable[str]) -> str | None:
    """The best node for `key`, or None when there are none."""
    order = rendezvous_order(key, nodes)
    return order[0] if order else None
