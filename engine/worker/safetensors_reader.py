"""Reads tensors, or one rank's slice of them, out of a .safetensors file with plain reads into
fresh tensors: no memory map.

NOTE: safetensors' `safe_open` maps the file; every page a copy reads stays resident (and counts
in the process's RSS) until the file is closed, i.e. for the whole load: the loading peak was
weights + the file's touched pages (~2x the weights at N = 1; and at N = 2 a column slice of
o_proj / down_proj touches every page of the tensor). Reading with `preadv` puts the bytes only
in the page cache (not this process's memory) and in the tensor we return; a slice along a
dimension > 0 is read a few MiB of whole rows at a time through one scratch buffer.

Format: 8 bytes little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end)}, "__metadata__": ...}, then the data (offsets relative to it).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip

SCRATCH_BYTES = 4 << 20
"""Whole rows read at a time for a slice along a dimension > 0."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the first element in the file."""


class SafetensorsReader:
    """One open .safetensors file; use as a context manager."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            (size,) = struct.unpack("<Q", self._read(8, 0))
            header = json.loads(self._read(size, 8))
        except BaseException:
            os.close(self.fd)
            raise
        header.pop("__metadata__", None)
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if entry["dtype"] not in DTYPES:
                os.close(self.fd)
                raise ValueError(f"{self.path}: tensor {name!r} has unknown dtype {entry['dtype']}")
            begin = 8 + size + int(entry["data_offsets"][0])
            self.tensors[name] = TensorInfo(DTYPES[entry["dtype"]], tuple(entry["shape"]), begin)

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def names(self) -> Iterator[str]:
        """Tensor names in file order (by offset)."""
        return iter(sorted(self.tensors, key=lambda n: self.tensors[n].offset))

    def _read(self, n: int, offset: int) -> bytes:
        data = os.pread(self.fd, n, offset)
        if len(data) != n:
            raise ValueError(f"{self.path} is truncated (read {len(data)} of {n} bytes)")
        return data

    def _read_into(self, buf: torch.Tensor, offset: int) -> None:
        """Fills the contiguous uint8 tensor `buf` from `offset`."""
        view = buf.numpy().data.cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise ValueError(f"{self.path} is truncated at byte {offset + done}")
            done += n

    def get(self, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """Tensor `name`, or with part = (dim, start, length) its slice [start, start + length)
        along dim; a fresh contiguous tensor on the CPU."""
        info = self.tensors[name]
        shape = list(info.shape)
        dim, start, length = part if part is not None else (0, 0, shape[0] if shape else 1)
        es = info.dtype.itemsize
        outer = math.prod(shape[:dim])
        size = shape[dim] if shape else 1
        inner = math.prod(shape[dim + 1 :]) * es  # bytes per index along dim
        if not 0 <= start <= start + length <= size:
            raise ValueError(f"{name}: slice [{start}, {start + length}) of {size} along {dim}")
        if shape:
            shape[dim] = length
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=info.dtype)
        out = torch.empty(outer, length * inner, dtype=torch.uint8)  # [outer, slice bytes]
        if outer == 1 or length == size:  # one contiguous range
            self._read_into(out, info.offset + start * inner)
        else:
            row = size * inner  # bytes of one outer index
            rows = max(1, SCRATCH_BYTES // row)
            scratch = torch.empty(min(rows, outer), row, dtype=torch.uint8)
            for first in range(0, outer, rows):
                n = min(rows, outer - first)
                self._read_into(scratch[:n], info.offset + first * row)
                out[first : first + n].copy_(scratch[:n, start * inner : (start + length) * inner])
        return out.view(info.dtype).view(shape)
