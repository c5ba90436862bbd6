"""The engine's host-memory buffers: each is capped by bytes and by a share of the tier
it serves, and reported with its size and caps; the CPU tier is paid for at start; freed host
memory goes back to the OS between steps."""

from __future__ import annotations

from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.kv_io.disk import DiskFiles
from engine.kv_io.host_memory import HostMemoryTrimmer
from engine.stats import BufferStats
from service.replica.convert import cache_stats_message

PAYLOAD = 4096
MANIFEST = {"format": "test", "model_id": "m", "dtype": "float32", "block_size": 4}


def h(i: int) -> bytes:
    return i.to_bytes(2, "little") * 16


def test_read_cache_and_write_queue_are_capped_by_bytes_and_by_the_tier(tmp_path: Path) -> None:
    # 80-block tier: the share caps (1/8 and 1/4 of it) are below the byte caps
    files = DiskFiles.open(tmp_path, MANIFEST, PAYLOAD, 10**6, capacity_blocks=80)
    assert files is not None
    try:
        assert files.read_cache_blocks == 10
        assert files.max_queued == 20
        for i in range(30):
            assert files.store(h(i), torch.full((PAYLOAD,), i % 251, dtype=torch.uint8))
            files.flush()  # written before the next, so the queue never refuses here
        files.end_step()
        for i in range(30):
            assert files.probe(h(i))  # read back from its file
        read_cache, write_queue = files.buffers()
        assert read_cache == BufferStats("disk_read_cache", 30, 30 * PAYLOAD, 10, 10 * PAYLOAD)
        files.end_step()  # the step's reads beyond the cap are dropped, oldest first
        read_cache, write_queue = files.buffers()
        assert read_cache == BufferStats("disk_read_cache", 10, 10 * PAYLOAD, 10, 10 * PAYLOAD)
        assert write_queue == BufferStats("disk_write_queue", 0, 0, 20, 20 * PAYLOAD)
        assert files.probe(h(29)) and torch.equal(
            files.buffered(h(29)), torch.full((PAYLOAD,), 29, dtype=torch.uint8)
        )
    finally:
        files.close()
    # a large tier: the byte caps hold
    big = DiskFiles.open(
        tmp_path, MANIFEST, PAYLOAD, 5 * PAYLOAD, max_queued=256, write_queue_bytes=7 * PAYLOAD,
        capacity_blocks=10**6,
    )  # fmt: skip
    assert big is not None
    try:
        assert (big.read_cache_blocks, big.max_queued) == (5, 7)
        assert big.room() == 7
    finally:
        big.close()


def test_engine_reports_its_buffers_and_zeroes_the_cpu_tier(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    llm = LLM(
        str(tiny_llama_path),
        block_size=16,
        num_device_blocks=64,
        num_cpu_blocks=24,
        disk_dir=str(tmp_path / "disk"),
        disk_gib=0.01,
        disk_read_cache_mib=1.0,
    )
    eng = llm.engine
    assert eng.core.offload is not None and eng.core.offload.disk is not None
    cpu = eng.core.offload.cpu_cache
    assert cpu.count_nonzero().item() == 0  # allocated and touched at start
    block = eng.core.block_bytes
    llm.generate([list(range(10, 200))], SamplingParams(max_tokens=4, ignore_eos=True))
    stats = eng.get_stats()
    by_name = {b.name: b for b in stats.buffers}
    assert set(by_name) == {"cpu_tier", "disk_read_cache", "disk_write_queue"}
    assert by_name["cpu_tier"] == BufferStats("cpu_tier", 24, cpu.nbytes, 24, cpu.nbytes)
    capacity = next(t.num_blocks for t in stats.tiers if t.name == "disk")
    read_cap = min(2**20 // block, capacity // 8)
    assert by_name["disk_read_cache"].max_entries == max(1, read_cap)
    assert by_name["disk_write_queue"].max_entries == max(1, min(256, capacity // 4))
    for b in stats.buffers:
        assert b.bytes <= b.max_bytes and b.entries <= b.max_entries
    msg = cache_stats_message(stats, eng.model_info, "r0")
    assert [(b.name, b.max_bytes) for b in msg.buffers] == [
        (b.name, b.max_bytes) for b in stats.buffers
    ]
    eng.close()


def test_trimmer_trims_at_most_every_interval() -> None:
    trimmer = HostMemoryTrimmer(every_s=10.0)
    assert trimmer.available  # glibc on every machine this project runs on
    # A start that floats hold exactly: with time.monotonic()'s own value, (start + 10.0) - start
    # can round to just under 10.0 and the test would fail for the clock's sake, not the code's.
    start = trimmer._last = 1024.0
    assert not trimmer.maybe_trim(start + 5.0)
    assert trimmer.maybe_trim(start + 10.0)
    assert not trimmer.maybe_trim(start + 19.0)
    assert trimmer.maybe_trim(start + 20.5)
    assert trimmer.num_trims == 2
