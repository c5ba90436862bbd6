"""CPU-only checks of the CUDA kernels and their loaders (run in CI without a GPU).

1. Every cuda/*.cu compiles with the local nvcc to PTX for sm_90, with every template
   instantiation its loader may ask NVRTC for (the loaders' `instantiations()`), from exactly the
   source text the loader hands to CuPy (deja_common.cuh pasted in).
2. The loaders reject bad shapes, dtypes, strides and devices with ValueError before touching
   CUDA or importing CuPy.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cuda import block_copy, paged_attention, prefill_attention, reshape_and_cache
from cuda.cupy_launch import CUDA_DIR, kernel_source
from tests.cuda_emu.emulator import LOADERS


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/nvcc", "/usr/bin/nvcc"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def test_every_cu_file_has_a_loader() -> None:
    assert sorted(p.name for p in CUDA_DIR.glob("*.cu")) == sorted(m.CU_FILE for m in LOADERS)
    assert not (CUDA_DIR / "__init__.py").exists()  # namespace package shared with cuda-python


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc is not installed")
def test_kernels_compile_with_nvcc(tmp_path: Path) -> None:
    nvcc = find_nvcc()
    assert nvcc is not None
    procs = []
    for module in LOADERS:
        names = module.instantiations()
        assert names and len(names) == len(set(names))
        # Taking each kernel's address instantiates it, as NVRTC's name expressions do.
        refs = ",\n".join(f"  (void*)&{name}" for name in names)
        source = kernel_source(module.CU_FILE) + f"\nvoid* deja_instances[] = {{\n{refs}\n}};\n"
        stem = module.CU_FILE.removesuffix(".cu")
        src = tmp_path / f"{stem}_check.cu"
        src.write_text(source)
        ptx = tmp_path / f"{stem}.ptx"
        cmd = [nvcc, "--ptx", "-arch=sm_90", "-std=c++17", str(src), "-o", str(ptx)]
        procs.append((module, names, ptx, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)))
    failures = []
    for module, names, ptx, proc in procs:
        _, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            failures.append(f"{module.CU_FILE}:\n{err[-4000:]}")
            continue
        entries = ptx.read_text().count(".entry ")
        if entries != len(names):
            failures.append(f"{module.CU_FILE}: {entries} kernels in PTX, expected {len(names)}")
    assert not failures, "\n".join(failures)


# ---- loader argument checks (CPU tensors; every check runs before any CUDA call) -------------


def _layer_cache(dtype: torch.dtype = torch.bfloat16, bs: int = 16, d: int = 64) -> torch.Tensor:
    return torch.zeros(2, 4, bs, 2, d, dtype=dtype)


def _attention_args(
    num_tokens: int, seq_lens: list[int], over: dict[str, object], **own: object
) -> dict[str, object]:
    """Valid arguments of an attention loader (bf16, [T, 4, 64] queries, a 2-block table per
    sequence, the loader's `own` ones), then `over` on top."""
    args: dict[str, object] = dict(
        out=torch.empty(num_tokens, 4, 64, dtype=torch.bfloat16),
        q=torch.empty(num_tokens, 4, 64, dtype=torch.bfloat16),
        kv_cache=_layer_cache(),
        block_tables=torch.zeros(len(seq_lens), 2, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        scale=0.125,
        **own,
    )
    args.update(over)
    return args


def _decode_args(**over: object) -> dict[str, object]:
    return _attention_args(3, [1, 1, 1], over, max_seq_len=20)


def _prefill_args(**over: object) -> dict[str, object]:
    query_start_loc = torch.tensor([0, 2, 5], dtype=torch.int32)
    return _attention_args(5, [3, 4], over, query_start_loc=query_start_loc, max_query_len=3)


BF = torch.bfloat16
DECODE_BAD: dict[str, tuple[dict[str, object], str]] = {
    "q dtype": (dict(q=torch.empty(3, 4, 64, dtype=torch.float64)), "q must have dtype"),
    "head size": (
        dict(
            q=torch.empty(3, 4, 80, dtype=BF),
            out=torch.empty(3, 4, 80, dtype=BF),
            kv_cache=_layer_cache(d=80),
        ),
        "head_dim must be one of",
    ),
    "block size": (dict(kv_cache=_layer_cache(bs=8)), "block_size must be one of"),
    "gqa": (
        dict(q=torch.empty(3, 3, 64, dtype=BF), out=torch.empty(3, 3, 64, dtype=BF)),
        "multiple of KV heads",
    ),
    "tables dtype": (dict(block_tables=torch.zeros(3, 2, dtype=torch.int64)), "block_tables"),
    "rows": (dict(seq_lens=torch.ones(2, dtype=torch.int32)), "must have 3 rows"),
    "mixed dtypes": (dict(kv_cache=_layer_cache(torch.float16)), "dtypes differ"),
    "strided q": (dict(q=torch.empty(3, 64, 4, dtype=BF).transpose(1, 2)), "dense"),
    "max_seq_len": (dict(max_seq_len=33), "exceeds the block tables"),
    "cpu": ({}, "CUDA device"),
}


PREFILL_BAD: dict[str, tuple[dict[str, object], str]] = {
    "qsl length": (dict(query_start_loc=torch.tensor([0, 5], dtype=torch.int32)), "sequences"),
    "qsl dtype": (dict(query_start_loc=torch.tensor([0, 2, 5])), "query_start_loc"),
    "out shape": (dict(out=torch.empty(4, 4, 64, dtype=BF)), "out shape"),
    "cache rank": (dict(kv_cache=torch.zeros(4, 16, 2, 64, dtype=BF)), "5 dimensions"),
    "cache strides": (
        dict(kv_cache=torch.zeros(2, 4, 2, 16, 64, dtype=BF).transpose(2, 3)),
        "contiguous",
    ),
    "cpu": ({}, "CUDA device"),
}


LOADER_BAD: dict[str, tuple[Callable[..., None], dict[str, object], str]] = {
    **{
        f"decode {name}": (paged_attention.paged_decode_attention, _decode_args(**over), message)
        for name, (over, message) in DECODE_BAD.items()
    },
    **{
        f"prefill {name}": (prefill_attention.paged_prefill_attention, _prefill_args(**over), msg)
        for name, (over, msg) in PREFILL_BAD.items()
    },
}


@pytest.mark.parametrize("case", LOADER_BAD, ids=list(LOADER_BAD))
def test_attention_loaders_reject(case: str) -> None:
    loader, args, message = LOADER_BAD[case]
    with pytest.raises(ValueError, match=message):
        loader(**args)


def test_reshape_and_cache_rejects() -> None:
    k = torch.zeros(5, 2, 64, dtype=BF)
    slots = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        reshape_and_cache.reshape_and_cache(k, k, _layer_cache(), slots.int())
    with pytest.raises(ValueError, match="entries for 5 tokens"):
        reshape_and_cache.reshape_and_cache(k, k, _layer_cache(), slots[:4])
    with pytest.raises(ValueError, match="kv_cache must be"):
        reshape_and_cache.reshape_and_cache(k, k, _layer_cache(d=128), slots)
    with pytest.raises(ValueError, match="CUDA device"):
        reshape_and_cache.reshape_and_cache(k, k, _layer_cache(), slots)


def test_block_copy_rejects() -> None:
    cache = torch.zeros(2, 2, 4, 16, 2, 64, dtype=BF)
    ids = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"src .* and dst .* differ"):
        block_copy.copy_blocks(cache, ids, ids[:1])
    with pytest.raises(ValueError, match=r"must have dtype torch\.int64"):
        block_copy.copy_blocks(cache, ids.int(), ids)
    with pytest.raises(ValueError, match="staging must be"):
        block_copy.gather_blocks(cache, ids, torch.zeros(2, 2, 3, 16, 2, 64, dtype=BF))
    with pytest.raises(ValueError, match="CUDA device"):
        block_copy.scatter_blocks(torch.zeros(2, 2, 2, 16, 2, 64, dtype=BF), cache, ids)


def test_loaders_import_without_cupy() -> None:
    """Importing the loaders and the backend module never imports CuPy."""
    code = (
        "import sys\n"
        "import cuda.paged_attention, cuda.prefill_attention, cuda.block_copy\n"
        "import cuda.reshape_and_cache, engine.worker.attention.cupy_backend\n"
        "assert 'cupy' not in sys.modules, 'cupy imported at module import time'\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
    assert importlib.util.find_spec("cuda.paged_attention") is not None
