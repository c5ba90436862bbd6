"""Process-stable block hashes.

A full block's hash is sha256 over a canonical byte encoding of
    (domain tag, parent hash, the block's token ids, extra keys)
where the extra keys are the model identity, the tenant's cache salt and the adapter. The same
prompt gives the same chain in every process and on every machine, so the router, Redis and the
disk tier can all use these hashes as keys. Python's salted `hash()` is never used.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""32 bytes of sha256."""

_DOMAIN = b"deja-block-v1"
_ROOT = bytes(32)
"""Parent of the first block."""


def _field(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    data = value.encode("utf-8")
    return b"\x01" + struct.pack("<I", len(data)) + data


def extra_keys(model_id: str, cache_salt: str | None = None, adapter: str | None = None) -> bytes:
    """Canonical bytes of the keys that separate caches: model, tenant salt, adapter."""
    return _field(model_id) + _field(cache_salt) + _field(adapter)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(_DOMAIN)
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on.

    `parent` is the hash of block `start_block - 1` (None when starting at block 0); a partly
    filled tail is not hashed.
    """
    out: list[BlockHash] = []
    n_full = len(token_ids) // block_size
    for i in range(start_block, n_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out
