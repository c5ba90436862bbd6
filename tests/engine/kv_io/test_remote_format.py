"""The remote tier's values: a value reads back as its payload only for its block and layout."""

from __future__ import annotations

import pytest
import torch

from engine.kv_io.remote_format import BadValue, decode, encode, key

TAG, OTHER_TAG = b"t" * 16, b"o" * 16
BLOCK, OTHER_BLOCK = b"\x01" * 32, b"\x02" * 32


def test_a_value_reads_back_and_every_fault_has_its_reason() -> None:
    payload = torch.arange(256, dtype=torch.uint8).repeat(4)
    value = encode(BLOCK, payload, TAG)
    assert torch.equal(decode(value, BLOCK, payload.numel(), TAG), payload)
    cases = {
        "truncated": (value[:-1], BLOCK, TAG),
        "format": (b"NOTDEJA!" + value[8:], BLOCK, TAG),
        "foreign": (value, BLOCK, OTHER_TAG),
        "other_block": (value, OTHER_BLOCK, TAG),
        "checksum": (value[:-1] + bytes([value[-1] ^ 1]), BLOCK, TAG),
    }
    for reason, (v, block, tag) in cases.items():
        with pytest.raises(BadValue) as err:
            decode(v, block, payload.numel(), tag)
        assert err.value.reason == reason


def test_keys_name_the_layout_and_the_block() -> None:
    k = key("deja:kv:", TAG, BLOCK)
    assert k == f"deja:kv:{TAG.hex()[:16]}:{BLOCK.hex()}"
    assert k != key("deja:kv:", OTHER_TAG, BLOCK)
