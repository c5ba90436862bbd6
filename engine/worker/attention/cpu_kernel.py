"""Builds and loads the CPU kernels (cpu_paged_attention.cpp, and the models' RMSNorm, fused
add + RMSNorm and RoPE, models/layers/cpu_layers.cpp), once per machine.

The kernel is compiled with the machine's own C++ compiler for the machine's own CPU
(`-O3 -march=native -fopenmp`, against the installed torch's headers and libraries) into
`<build root>/<key>/deja_cpu_attn.so`, where the key hashes the source, the flags, the torch
version, the compiler's version and the CPU's feature flags: a new source, torch, compiler or CPU
gets a new build, an unchanged one is loaded in milliseconds. `scripts/install.sh` builds it
(`python -m engine.worker.attention.cpu_kernel`); the first use builds it if the install did not
(about 20 s). Without a compiler, or if the build fails, `load_kernel` says why and the engine
keeps the torch attention backend.

NOTE: one compiler call, not torch.utils.cpp_extension.load: that needs ninja and a Python
extension module; the kernel is a plain shared library that registers `torch.ops.deja_cpu_attn`.
The output is written to a temporary name and renamed, so concurrent builders never see half a
file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from engine.worker.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
SOURCES = (
    SOURCE,
    Path(__file__).parents[1] / "models" / "layers" / "cpu_layers.cpp",
    Path(__file__).parents[1] / "models" / "layers" / "cpu_quant.cpp",
    Path(__file__).parents[1] / "models" / "layers" / "cpu_quant_i8.cpp",
    Path(__file__).parents[1] / "models" / "layers" / "cpu_quant_bf16.cpp",
    Path(__file__).parents[1] / "models" / "layers" / "cpu_decoder.cpp",
)
"""Compiled into one library: the paged attention, the decoder layers' small ops, the quantized
linears and the decoder stack that runs a step's layers over them."""
HEADERS = (Path(__file__).parents[1] / "models" / "layers" / "cpu_ops.h",)
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
LIBRARY = "deja_cpu_attn.so"


def default_build_root() -> Path:
    return Path.home() / ".cache" / "deja" / "kernels"


@dataclass(frozen=True, slots=True)
class KernelLoad:
    """What `load_kernel` found: the loaded library, or why there is none."""

    ops: object | None
    """torch.ops.deja_cpu_attn (paged_attention, rms_norm, add_rms_norm, rope) when loaded; None
    otherwise."""
    path: Path | None
    """The shared library loaded (None when none was)."""
    reason: str
    """How it was obtained ("cached build", "built in 18.2 s") or why it is missing."""


def _compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def build_key(cxx: str) -> str:
    """Hash of everything the library depends on (source, flags, torch, compiler, CPU)."""
    h = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in (*SOURCES, *HEADERS)),
        " ".join(CXX_FLAGS).encode(),
        torch.__version__.encode(),
        _compiler_version(cxx).encode(),
        " ".join(sorted(cpu_flags())).encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _compile(cxx: str, target: Path) -> None:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libdirs = cpp_extension.library_paths()
    cmd = [
        cxx,
        *CXX_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes,
        *(str(source) for source in SOURCES),
        *(f"-L{p}" for p in libdirs),
        *(f"-Wl,-rpath,{p}" for p in libdirs),
        "-lc10",
        "-ltorch_cpu",
        "-o",
    ]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([*cmd, tmp], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({done.returncode}): {done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def load_kernel(build_root: Path | None = None, build: bool = True) -> KernelLoad:
    """Loads the kernel, building it first when no build for this machine exists (and `build`).

    Never raises for a missing compiler or a failed build: the result says why. Logs once
    (per process and build root) which path attention will take."""
    import time

    cxx = _compiler()
    if cxx is None:
        out = KernelLoad(None, None, "no C++ compiler (c++ / g++) on PATH")
    else:
        target = (build_root or default_build_root()) / build_key(cxx) / LIBRARY
        how = "cached build"
        try:
            if not target.exists():
                if not build:
                    raise RuntimeError(f"not built yet ({target})")
                start = time.perf_counter()
                _compile(cxx, target)
                how = f"built in {time.perf_counter() - start:.1f} s"
            torch.ops.load_library(str(target))
            out = KernelLoad(torch.ops.deja_cpu_attn, target, how)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            out = KernelLoad(None, None, f"build or load failed: {e}")
    if out.ops is not None:
        logger.info("CPU paged attention: C++ kernel (%s, %s)", out.reason, out.path)
    else:
        logger.warning("CPU paged attention kernel unavailable (%s): torch attention", out.reason)
    return out


def main() -> int:
    """`python -m engine.worker.attention.cpu_kernel [BUILD_ROOT]`: build (or find) the kernel;
    exit status 0 either way (the torch backend is the fallback), the outcome printed."""
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    result = load_kernel(root)
    if result.ops is not None:
        print(f"CPU attention kernel: {result.path} ({result.reason})")
    else:
        print(f"CPU attention kernel not available, torch attention will be used: {result.reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
