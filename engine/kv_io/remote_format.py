"""The remote tier's values and keys: what one replica writes and every other one may read.

A value is a 128-byte header and the block's bytes, as a disk block file is
(engine/kv_io/disk_format.py): magic with the format version, the block hash, the payload length,
the XXH3-128 digest of the payload and the writer's layout tag, then the payload
[num_layers, 2, block_size, num_kv_heads (this rank's share), head_dim] in the KV dtype, C order.
The tag is the digest of the writer's manifest (model identity and fingerprint, dtype, KV dtype
and fp8 scales, block size, layout, tensor-parallel share), so a reader under another model, KV
encoding or tensor-parallel layout never takes a value for its own.

A key is `<prefix><tag, 16 hex digits>:<block hash, 64 hex digits>`: the block hash already
chains over the model identity and the tenant's cache salt; the tag keeps deployments of one
model with different KV layouts (and each tensor-parallel rank's share) apart in one store.

NOTE: Redis writes a value whole or not at all, but nothing stops a bug, an operator or another
program from putting other bytes under a key: the reader checks every value (`decode`), and a
value that fails is a miss counted by its reason (MISS_REASONS), never a wrong load.
"""

from __future__ import annotations

import struct

import torch

from engine.kv.hashing import BlockHash
from engine.kv_io.disk_format import HEADER_BYTES, digest

FORMAT = "deja-kv-remote-v1"
_MAGIC = b"DEJAKR\x00\x01"
_HEADER = struct.Struct("<8s32sQ16s16s")
"""magic, block hash, payload bytes, XXH3-128 digest of the payload, writer's layout tag."""

MISS_REASONS = ("truncated", "format", "foreign", "other_block", "checksum", "error")
"""Why a lookup found no usable value besides plain absence: truncated (shorter or longer than a
block), format (not a deja value, or another format version), foreign (another model, KV
encoding or tensor-parallel layout), other_block (the header names another block: another
tenant's or another prefix's value under this key), checksum (the bytes are corrupt), error (the
store failed or timed out)."""


class BadValue(Exception):
    """A value that is there but not this block's, by one of MISS_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def key(prefix: str, tag: bytes, block_hash: BlockHash) -> str:
    return f"{prefix}{tag.hex()[:16]}:{block_hash.hex()}"


def encode(block_hash: BlockHash, payload: torch.Tensor, tag: bytes) -> bytes:
    """Header and payload ([payload_bytes] uint8, contiguous) as one value."""
    data = payload.numpy().data
    header = _HEADER.pack(_MAGIC, block_hash, data.nbytes, digest(data), tag)
    return header.ljust(HEADER_BYTES, b"\0") + data


def decode(value: bytes, block_hash: BlockHash, payload_bytes: int, tag: bytes) -> torch.Tensor:
    """The value's verified payload ([payload_bytes] uint8, a view of `value`'s bytes).

    Raises BadValue with its reason when the value is not this block's under this layout.
    """
    if len(value) != HEADER_BYTES + payload_bytes:
        raise BadValue("truncated", f"{len(value)} bytes, expected {HEADER_BYTES + payload_bytes}")
    magic, stored_hash, length, stored_digest, stored_tag = _HEADER.unpack_from(value)
    if magic != _MAGIC:
        raise BadValue("format", "another format's value" if magic[:6] == _MAGIC[:6] else "magic")
    if stored_tag != tag:
        raise BadValue("foreign", "written under another model, KV encoding or layout")
    if stored_hash != block_hash:
        raise BadValue("other_block", "the header names another block")
    if length != payload_bytes:
        raise BadValue("truncated", f"payload length {length}")
    view = memoryview(value)[HEADER_BYTES:]
    if digest(view) != stored_digest:
        raise BadValue("checksum", "the payload's digest does not match")
    return torch.frombuffer(bytearray(view), dtype=torch.uint8)
