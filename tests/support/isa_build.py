"""The CPU kernels' sources built for one instruction set (`-march=...`) into a library of their
own, for the tests that check every path a kernel has on whatever CPU runs them."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine.worker.attention import cpu_kernel

RUNS_ON = {"haswell": ("avx2", "fma")}
"""Flags a CPU needs to run a build for these -march values (native and x86-64 run anywhere; a
test checks its own others, e.g. cooperlake)."""


def build_library(sources: Sequence[Path], march: str, out: Path) -> Path:
    """`sources` compiled with the kernel loader's flags but `-march=march` into `out` (the test
    skips where there is no C++ compiler or this CPU cannot run the build; a failed build fails
    it with the compiler's output)."""
    cxx = compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    if not cpu_has(*RUNS_ON.get(march, ())):
        pytest.skip(f"this CPU cannot run a -march={march} build")
    from torch.utils import cpp_extension

    flags = [f for f in cpu_kernel.CXX_FLAGS if not f.startswith("-march")]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [
        cxx,
        *flags,
        f"-march={march}",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        *(str(source) for source in sources),
        *(f"-L{p}" for p in cpp_extension.library_paths()),
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(out),
    ]
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    return out


def compiler() -> str | None:
    """The C++ compiler the builds use, if any."""
    return shutil.which("g++") or shutil.which("c++")


def cpu_has(*features: str) -> bool:
    """This CPU has these /proc/cpuinfo flags."""
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return set(features) <= flags
