"""The plain-read safetensors reader against safetensors' own: whole tensors and every slice
the tensor-parallel loader asks for (rows, columns, inner dims), in several dtypes; and the
loader does not map the file (the loading peak a map caused)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.worker import safetensors_reader
from engine.worker.safetensors_reader import SafetensorsReader


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w32": torch.randn(37, 53, generator=g),
        "w16": torch.randn(64, 24, generator=g).to(torch.bfloat16),
        "h16": torch.randn(5, 6, 7, generator=g).to(torch.float16),
        "ids": torch.arange(11, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "fp8": torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_whole_tensors_match_safe_open(checkpoint: Path) -> None:
    with safe_open(str(checkpoint), framework="pt") as ref, SafetensorsReader(checkpoint) as f:
        assert sorted(f.names()) == sorted(ref.keys())
        for name in f.names():
            got, want = f.get(name), ref.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(
                got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
            )


@pytest.mark.parametrize("scratch", [1 << 20, 100])  # one chunk of rows; many, some partial
@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("w32", (0, 5, 17)),
        ("w32", (1, 0, 27)),
        ("w32", (1, 26, 27)),
        ("w16", (1, 12, 12)),
        ("w16", (0, 32, 32)),
        ("h16", (1, 2, 3)),
        ("h16", (2, 4, 3)),
        ("ids", (0, 6, 5)),
        ("w32", (1, 3, 0)),
    ],
)
def test_slices_match_get_slice(
    checkpoint: Path, name: str, part: tuple[int, int, int], scratch: int, monkeypatch: Any
) -> None:
    monkeypatch.setattr(safetensors_reader, "SCRATCH_BYTES", scratch)
    dim, start, length = part
    with safe_open(str(checkpoint), framework="pt") as ref, SafetensorsReader(checkpoint) as f:
        index = (slice(None),) * dim + (slice(start, start + length),)
        want = ref.get_slice(name)[index]
        got = f.get(name, part)
        assert got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want)


def test_refuses_out_of_range_slice_and_truncated_file(checkpoint: Path, tmp_path: Path) -> None:
    with SafetensorsReader(checkpoint) as f, pytest.raises(ValueError, match="slice"):
        f.get("w32", (1, 50, 10))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(checkpoint.read_bytes()[:-100])
    with SafetensorsReader(cut) as f, pytest.raises(ValueError, match="truncated"):
        f.get("fp8")


def test_loader_does_not_map_the_file(checkpoint: Path) -> None:
    """iter_weights reads; a map would keep every page it touched resident until the end."""
    from engine.worker.model_loader import iter_weights

    names = []
    for name, _ in iter_weights(checkpoint.parent):
        names.append(name)
        maps = Path("/proc/self/maps").read_text()
        assert str(checkpoint) not in maps
    assert len(names) == 6
