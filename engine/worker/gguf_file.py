"""A GGUF file's metadata and tensor table, read in one pass over a memory map.

`gguf.GGUFReader` makes a numpy view for every element of every metadata array: on a file with
a 49k-token vocabulary and 49k merges that is ~1M views and 1.5-3 s, paid again by each reader.
Here the metadata is read with `struct` and string arrays are stepped over unless asked for
(the tokenizer reads them itself), which takes milliseconds; tensors are views into the map in
the layout GGUFReader gives them (values for F16 / F32 / F64 / integer types, a uint8
[rows, bytes a row] view for a block type and BF16), so `gguf.quants.dequantize` takes them.
(transformers' own fast reader lists tensor names only, and refuses types its dequantizer lacks,
where every type gguf dequantizes loads here.)
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
"""llama.cpp's, where `general.alignment` is absent."""

_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
"""GGUF metadata value type -> struct format (u8, i8, u16, ..., bool, u64, i64, f64; little-endian);
8 is a string, 9 an array."""
_STRING, _ARRAY = 8, 9

_VALUE_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8}
_VALUE_TYPES |= {"I16": np.int16, "I32": np.int32, "I64": np.int64}
"""Tensor types GGUFReader gives as values (others as bytes)."""


@dataclass(frozen=True, slots=True, eq=False)
class GGUFTensor:
    name: str
    kind: Any
    """The gguf.GGMLQuantizationType."""
    dims: tuple[int, ...]
    """As the file lists them: innermost first."""
    offset: int
    """Where its data starts in the file."""
    nbytes: int
    data: np.ndarray
    """Read-only view into the file (see the module docstring for its layout)."""


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    """Key -> int, float, bool, str, list of numbers, or list of str for the string arrays
    asked for (the count of items for the others)."""
    tensors: tuple[GGUFTensor, ...]

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def one(self, fmt: str) -> Any:
        return self.take(fmt)[0]

    def string(self) -> str:
        n = self.one("Q")
        self.pos += n
        if self.pos > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        return self.buf[self.pos - n : self.pos].decode("utf-8")

    def value(self, kind: int, keep_strings: bool) -> Any:
        if kind in _SCALARS:
            return self.one(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.take("IQ")
        if item in _SCALARS:
            return list(self.take(f"{count}{_SCALARS[item]}"))
        if item != _STRING:
            return [self.value(item, keep_strings) for _ in range(count)]
        if keep_strings:
            return [self.string() for _ in range(count)]
        for _ in range(count):  # (lengths only: nothing but a walk finds the end)
            self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
        return count


def read_gguf(file: Path, string_arrays: Container[str] = ()) -> GGUFFile:
    """The file's metadata and tensors (views; no tensor data is read). Raises ValueError for a
    file that is not a whole GGUF file: wrong magic or version, an unknown type, a tensor past
    the end."""
    with open(file, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(file, buf, string_arrays)
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"its metadata is cut short or garbled ({e})") from e


def _parse(file: Path, buf: mmap.mmap, string_arrays: Container[str]) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

    if buf[:4] != MAGIC:
        raise ValueError(f"it starts with {buf[:4]!r}, not {MAGIC!r}")
    cur = _Cursor(buf)
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("IQQ")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        order = " (a big-endian file)" if swapped in VERSIONS else ""
        raise ValueError(
            f"GGUF version {version}{order}; deja reads little-endian versions 2 and 3"
        )
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise ValueError(f"metadata key {key!r} is listed twice")
        metadata[key] = cur.value(cur.one("I"), key in string_arrays)
    table: list[tuple[str, Any, tuple[int, ...], int]] = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = cur.string()
        dims = cur.take(f"{cur.one('I')}Q")
        kind, offset = cur.take("IQ")
        if name in names:
            raise ValueError(f"tensor {name!r} is listed twice")
        names.add(name)
        table.append((name, GGMLQuantizationType(kind), dims, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment is {alignment!r}, not a positive integer")
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, kind, dims, offset in table:
        block, size = GGML_QUANT_SIZES[kind]
        count = math.prod(dims)
        nbytes = count * size // block
        if start + offset + nbytes > len(buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        shape = tuple(reversed(dims))
        if kind.name in _VALUE_TYPES:
            data = np.frombuffer(buf, _VALUE_TYPES[kind.name], count, start + offset)
        else:
            data = np.frombuffer(buf, np.uint8, nbytes, start + offset)
            shape = quant_shape_to_byte_shape(shape, kind)
        tensors.append(GGUFTensor(name, kind, dims, start + offset, nbytes, data.reshape(shape)))
    return GGUFFile(file, metadata, tuple(tensors))
