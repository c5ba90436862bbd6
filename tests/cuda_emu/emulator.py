"""Builds the CUDA kernels for the CPU (host_shim.h + g++) and swaps them in for CuPy launches.

`Emulator.install(monkeypatch)` replaces each loader's `launch` (and its CUDA-only helpers), so a
test calls the real loaders with CPU tensors: their checks, grid sizes, argument lists and the
kernels themselves all run, only on the CPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cuda import (
    block_copy,
    layers,
    paged_attention,
    prefill_attention,
    quant_linear,
    reshape_and_cache,
)
from cuda.cupy_launch import CUDA_DIR

HERE = Path(__file__).resolve().parent
LOADERS = (reshape_and_cache, block_copy, paged_attention, prefill_attention, layers, quant_linear)
"""Every cuda/*.cu file's loader (tests/test_cuda_compile.py checks that none is missing)."""
CU_FILES = tuple(m.CU_FILE for m in LOADERS)
_CTYPES: dict[np.dtype[Any], type[ctypes._SimpleCData[Any]]] = {
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.float32): ctypes.c_float,
}


def find_compiler() -> str | None:
    return shutil.which("g++")


class Emulator:
    """A shared library with one exported launcher per kernel name expression."""

    def __init__(self, names: Sequence[str], build_dir: Path | None = None) -> None:
        compiler = find_compiler()
        if compiler is None:
            raise RuntimeError(
                "g++ is needed to emulate the CUDA kernels (scripts/install.sh --dev)"
            )
        self.names = sorted(set(names))
        self.symbols = {name: f"emu_{i}" for i, name in enumerate(self.names)}
        lines = ['#include "host_shim.h"']
        lines += [f'#include "{cu}"' for cu in CU_FILES]
        lines += [f"EMU_EXPORT({self.symbols[n]}, {n})" for n in self.names]
        source = "\n".join(lines) + "\n"
        inputs = source + "".join(
            p.read_text() for p in sorted([*CUDA_DIR.glob("*.cu*"), HERE / "host_shim.h"])
        )
        digest = hashlib.sha256(inputs.encode()).hexdigest()[:16]
        out_dir = build_dir or Path(tempfile.gettempdir()) / "deja-cuda-emu"
        out_dir.mkdir(parents=True, exist_ok=True)
        lib_path = out_dir / f"kernels-{digest}.so"
        if not lib_path.exists():
            src_path = out_dir / f"kernels-{digest}.cpp"
            src_path.write_text(source)
            tmp = lib_path.with_suffix(".tmp.so")
            cmd = [
                compiler,
                "-std=c++20",
                "-O1",
                "-shared",
                "-fPIC",
                "-pthread",
                "-fno-strict-aliasing",
                "-Wno-unknown-pragmas",
                f"-I{HERE}",
                f"-I{CUDA_DIR}",
                str(src_path),
                "-o",
                str(tmp),
            ]
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"emulator build failed:\n{result.stderr[-6000:]}")
            tmp.replace(lib_path)
        self.lib = ctypes.CDLL(str(lib_path))
        self.launches: list[tuple[str, tuple[int, int, int], tuple[int, int, int]]] = []

    def launch(
        self,
        cu_file: str,
        name_expression: str,
        device: torch.device,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None:
        """Same contract as cuda.cupy_launch.launch, run on the CPU."""
        assert cu_file in CU_FILES, cu_file
        if name_expression not in self.symbols:
            raise KeyError(f"{name_expression} was not built into the emulator")
        symbol = self.symbols[name_expression]
        sig_fn = getattr(self.lib, f"{symbol}_sig")
        sig_fn.restype = ctypes.c_char_p
        sizes = [int(s) for s in sig_fn().decode().split(",") if s]
        given = [np.asarray(a).dtype.itemsize for a in args]
        assert sizes == given, (
            f"{name_expression}: kernel takes {sizes} bytes, launch gives {given}"
        )
        values: list[ctypes._SimpleCData[Any]] = [
            _CTYPES[np.asarray(a).dtype](a.item()) for a in args
        ]
        argv = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        assert block[1] == block[2] == 1 and shared_mem == 0
        assert all(g >= 1 for g in grid) and grid[1] <= 65535 and grid[2] <= 65535
        self.launches.append((name_expression, grid, block))
        fn = getattr(self.lib, symbol)
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
        fn(grid[0], grid[1], grid[2], block[0], argv)

    def install(self, monkeypatch: pytest.MonkeyPatch, sm_count: int = 132) -> None:
        """Routes the loaders' launches here and lets them accept CPU tensors."""

        def check_cpu(**tensors: torch.Tensor) -> torch.device:
            devices = {t.device for t in tensors.values()}
            assert devices == {torch.device("cpu")}, devices
            return torch.device("cpu")

        for module in LOADERS:
            monkeypatch.setattr(module, "launch", self.launch)
            monkeypatch.setattr(module, "check_cuda", check_cpu)
        monkeypatch.setattr(paged_attention, "num_sms", lambda device: sm_count)
