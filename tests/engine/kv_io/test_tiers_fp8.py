"""fp8 blocks on every tier: the CPU and disk tiers hold them at their own size, a
restart reads them back with the scales they were written with, and a block file of another
format or KV encoding is a miss, never read as garbage."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.kv.hashing import hash_blocks
from engine.kv_io.disk import DiskFiles
from engine.kv_io.disk_format import _HEADER, HEADER_BYTES, manifest_tag, write_block_file
from engine.worker.attention.kv_quant import FP8_DTYPE
from tests.engine.kv_io.test_tiers_engine import (
    BS,
    GREEDY,
    MAX_TOKENS,
    _extra,
    close,
    count_computed,
    gen,
    rand_tokens,
    sessions,
    tier,
    tokens,
)

FP8 = "fp8_e4m3"


def fp8_llm(path: Path, **cfg: object) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BS, kv_cache_dtype=FP8, **cfg)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fp8_reference(tiny_llama_path: Path) -> Iterator[LLM]:
    """An fp8 pool that holds everything and no lower tiers: the expected fp8 outputs."""
    llm = fp8_llm(tiny_llama_path, num_device_blocks=1024, num_cpu_blocks=0)
    yield llm
    close(llm)


def test_fp8_blocks_through_cpu_and_disk_give_the_fp8_outputs(
    tiny_llama_path: Path, fp8_reference: LLM, tmp_path: Path
) -> None:
    work = sessions(8, 3)
    llm = fp8_llm(
        tiny_llama_path,
        num_device_blocks=28,
        num_cpu_blocks=24,
        disk_dir=str(tmp_path),
        disk_write_policy="write-back",
        max_num_seqs=2,
    )
    eng = llm.engine
    assert eng.core.offload is not None and eng.core.offload.cpu_cache.dtype == FP8_DTYPE
    info = eng.model_info
    assert eng.core.block_bytes == info.num_layers * 2 * BS * info.num_kv_heads * info.head_dim
    for turn in range(3):
        prompts = [s[turn] for s in work]
        expected = tokens(fp8_reference.generate(prompts, GREEDY))
        assert tokens(gen(llm, prompts, GREEDY)) == expected, f"turn {turn}"
    assert eng.core.tiers is not None
    c = eng.core.tiers.counters
    assert c.device_spills > 0 and c.cpu_swap_ins > 0 and c.disk_stores > 0 and c.disk_loads > 0
    assert tier(eng, "cpu").bytes_moved == (
        (c.device_spills + c.cpu_swap_ins + c.disk_stores) * eng.core.block_bytes
    )
    eng.core.offload.flush()
    files = list(tmp_path.glob("??/*.kv"))
    assert files and {f.stat().st_size for f in files} == {HEADER_BYTES + eng.core.block_bytes}
    close(llm)


def test_restart_adopts_the_disk_scales_and_serves_fp8_blocks(
    tiny_llama_path: Path, fp8_reference: LLM, tmp_path: Path
) -> None:
    prefix = rand_tokens(512, 21)
    first = fp8_llm(
        tiny_llama_path, num_device_blocks=48, num_cpu_blocks=40, disk_dir=str(tmp_path)
    )
    scales = first.engine.core.kv_scales
    assert scales is not None and scales.source == "calibrated"
    gen(first, [prefix + rand_tokens(10, 1)], GREEDY)
    for i in range(3):  # push the prefix out of the device and CPU tiers
        gen(first, [rand_tokens(700, 50 + i)], GREEDY)
    assert first.engine.core.offload is not None
    first.engine.core.offload.flush()
    close(first)

    llm = fp8_llm(tiny_llama_path, num_device_blocks=48, num_cpu_blocks=40, disk_dir=str(tmp_path))
    restored = llm.engine.core.kv_scales
    assert restored is not None and restored.source == "disk"
    assert (restored.k, restored.v) == (scales.k, scales.v)
    computed = count_computed(llm)
    prompt = prefix + rand_tokens(25, 22)
    out = gen(llm, [prompt], GREEDY)[0]
    assert out.token_ids == fp8_reference.generate([prompt], GREEDY)[0].token_ids
    assert out.cached_tokens.disk == 512
    assert computed[0] == 25 + MAX_TOKENS - 1
    close(llm)

    # A float32 KV engine on the same folder: another KV encoding, the tier stays off.
    f32 = LLM(str(tiny_llama_path), dtype="float32", block_size=BS, num_device_blocks=48,
              num_cpu_blocks=40, disk_dir=str(tmp_path))  # fmt: skip
    assert f32.engine.core.tiers is not None and f32.engine.core.tiers.disk is None
    assert len(gen(f32, [prompt], GREEDY)[0].token_ids) == MAX_TOKENS
    close(f32)
    hashes = hash_blocks(prefix, BS, _extra(llm))
    assert (tmp_path / hashes[0].hex()[:2] / f"{hashes[0].hex()}.kv").exists()


MANIFEST = {"format": "test", "kv_dtype": "float8_e4m3fn", "kv_scales": {"k": [0.5], "v": [1.0]}}
PAYLOAD = 4096


def _payload(seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (PAYLOAD,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_a_block_of_another_encoding_or_format_is_a_miss(tmp_path: Path) -> None:
    files = DiskFiles.open(tmp_path, MANIFEST, PAYLOAD)
    assert files is not None
    good, other, old = (bytes([i]) * 32 for i in (1, 2, 3))
    write_block_file(files.path(good), good, _payload(1), manifest_tag(MANIFEST))
    other_scales = {**MANIFEST, "kv_scales": {"k": [0.25], "v": [1.0]}}
    write_block_file(files.path(other), other, _payload(2), manifest_tag(other_scales))
    write_block_file(files.path(old), old, _payload(3), manifest_tag(MANIFEST))
    # the same file as deja-kv-disk-v2 wrote it: its magic, no tag
    data = bytearray(files.path(old).read_bytes())
    data[:8] = b"DEJAKV\x00\x02"
    files.path(old).write_bytes(bytes(data))
    assert _HEADER.unpack_from(data)[0] == b"DEJAKV\x00\x02"

    payload = files.read(good)
    assert payload is not None and torch.equal(payload, _payload(1))
    assert files.read(other) is None and files.read(old) is None  # misses, not garbage
    assert files.num_bad == 2
    assert not files.path(other).exists() and not files.path(old).exists()
    files.close()
