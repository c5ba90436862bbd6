"""The disk tier across restarts, crashes, shared directories and broken disks (issues 10, 15).

Write-through puts every computed block on disk once, off the step loop; these tests check what a
new engine on the same directory finds: after a graceful close (and with warm start, in the CPU
tier), after SIGKILL (every file that was complete), with two engines sharing the directory (one
budget), and that a directory that breaks mid-run turns the tier off while requests go on.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.kv.hashing import extra_keys, hash_blocks
from engine.kv_io.disk_format import HEADER_BYTES
from tests.support.prompts import rand_tokens

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
REPO = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).with_name("tier_child.py")


def make_llm(path: Path, **cfg: Any) -> LLM:
    return LLM(str(path), dtype="float32", block_size=BS, **cfg)


def disk_stats(llm: LLM) -> Any:
    return next(t for t in llm.engine.get_stats().tiers if t.name == "disk")


def block_files(d: Path) -> list[Path]:
    return [f for f in d.glob("??/*.kv")]


@pytest.fixture(scope="module")
def reference(tiny_llama_path: Path) -> Iterator[LLM]:
    """Caching off: the expected outputs."""
    llm = make_llm(
        tiny_llama_path, num_device_blocks=512, num_cpu_blocks=0, enable_prefix_caching=False
    )
    yield llm


@pytest.fixture(scope="module")
def fp8_reference(tiny_llama_path: Path) -> Iterator[LLM]:
    """Caching off, fp8 KV: the expected outputs of the fp8 engines."""
    llm = make_llm(
        tiny_llama_path,
        num_device_blocks=512,
        num_cpu_blocks=0,
        enable_prefix_caching=False,
        kv_cache_dtype="fp8_e4m3",
    )
    yield llm


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_restart_after_graceful_close_serves_the_hot_prefix(
    tiny_llama_path: Path, reference: LLM, fp8_reference: LLM, tmp_path: Path, kv: str
) -> None:
    """fp8_e4m3: the blocks on disk are fp8 (with the scales in the manifest, adopted at
    restart), and the outputs are the fp8 engine's."""
    if kv != "auto":
        reference = fp8_reference
    new_llm = functools.partial(make_llm, kv_cache_dtype=kv)
    prefix = rand_tokens(1024, 1)
    first = prefix + rand_tokens(20, 2)
    # A device pool that holds the hot prefix: nothing is ever evicted, so before write-through
    # nothing of it reached disk.
    llm = new_llm(tiny_llama_path, num_device_blocks=256, num_cpu_blocks=16, disk_dir=str(tmp_path))
    assert (
        llm.generate([first], GREEDY)[0].token_ids
        == reference.generate([first], GREEDY)[0].token_ids
    )
    assert llm.engine.core.tiers is not None and llm.engine.core.tiers.counters.disk_stores == 0
    assert llm.engine.close(timeout_s=30.0)
    assert len(block_files(tmp_path)) == (1024 + 20) // BS

    second = prefix + rand_tokens(30, 3)
    expected = reference.generate([second], GREEDY)[0].token_ids
    llm2 = new_llm(
        tiny_llama_path, num_device_blocks=256, num_cpu_blocks=16, disk_dir=str(tmp_path)
    )
    out = llm2.generate([second], GREEDY)[0]
    assert out.token_ids == expected
    assert out.cached_tokens.disk >= 0.98 * 1024
    llm2.engine.close()

    # Warm start: the most recently used blocks come back into the CPU tier in the background.
    llm3 = new_llm(
        tiny_llama_path,
        num_device_blocks=256,
        num_cpu_blocks=80,
        disk_dir=str(tmp_path),
        warm_start_blocks=80,
    )
    llm3.engine.core.load_warm_start(timeout_s=30.0)
    assert llm3.engine.core.tiers is not None and llm3.engine.core.tiers.counters.warm_blocks >= 64
    out = llm3.generate([second], GREEDY)[0]
    assert out.token_ids == expected
    assert out.cached_tokens.cpu >= 0.98 * 1024 and out.cached_tokens.disk == 0
    scales = llm3.engine.core.kv_scales
    assert (scales is None) == (kv == "auto") and (scales is None or scales.source == "disk")
    llm3.engine.close()


def test_sigkill_during_write_through_keeps_every_completed_write(
    tiny_llama_path: Path, reference: LLM, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(tiny_llama_path), str(tmp_path), "crash"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert child.stdout is not None
        for line in child.stdout:  # wait until a few requests are through
            if line.strip() == "done 3":
                break
        time.sleep(1.5)
        kill_at = time.time()
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    done_before = {
        f.name[: -len(".kv")] for f in block_files(tmp_path) if f.stat().st_mtime <= kill_at - 1.0
    }
    assert done_before, "no write completed a second before the kill"

    llm = make_llm(tiny_llama_path, num_device_blocks=128, num_cpu_blocks=8, disk_dir=str(tmp_path))
    extra = extra_keys(llm.engine.model_info.model_id)
    served = 0
    for i in range(64):
        prompt = rand_tokens(256, i)
        hashes = [h.hex() for h in hash_blocks(prompt, BS, extra)]
        if hashes[0] not in done_before and i > 4:
            break
        want = 0
        for h in hashes[: (len(prompt) - 1) // BS]:
            if h not in done_before:
                break
            want += BS
        query = prompt + rand_tokens(9, 1000 + i)
        out = llm.generate([query], GREEDY)[0]
        assert out.token_ids == reference.generate([query], GREEDY)[0].token_ids
        # every block whose file was complete is served from disk (newer files may add more)
        assert out.cached_tokens.disk >= want, f"prompt {i}"
        served += want
    assert served >= 4 * 256 - 4 * BS
    llm.engine.close()


def test_two_engines_sharing_a_directory_keep_one_budget(
    tiny_llama_path: Path, reference: LLM, tmp_path: Path
) -> None:
    probe = make_llm(tiny_llama_path, num_device_blocks=8, num_cpu_blocks=0)
    file_bytes = HEADER_BYTES + probe.engine.core.block_bytes
    budget_blocks = 48
    gib = budget_blocks * file_bytes / 2**30
    llms = [
        make_llm(
            tiny_llama_path,
            num_device_blocks=40,
            num_cpu_blocks=8,
            disk_dir=str(tmp_path),
            disk_gib=gib,
        )
        for _ in range(2)
    ]
    shared = rand_tokens(128, 7)  # both engines write (and read) the same prefix files
    work = [[shared + rand_tokens(60, 100 * e + i) for i in range(12)] for e in range(2)]
    results: list[list[list[int]]] = [[], []]
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], len(block_files(tmp_path)))
            time.sleep(0.02)

    def run(e: int) -> None:
        for p in work[e]:
            results[e].append(llms[e].generate([p], GREEDY)[0].token_ids)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=run, args=(e,)) for e in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for llm in llms:
        assert llm.engine.close(timeout_s=30.0)
    stop.set()
    watcher.join()
    for e in range(2):
        assert results[e] == [o.token_ids for o in reference.generate(work[e], GREEDY)]
    files = block_files(tmp_path)
    assert len(files) <= budget_blocks
    assert all(f.stat().st_size == file_bytes for f in files)
    store = llms[0].engine.core.offload
    assert store is not None and store.disk is not None
    # between scans each engine may run ahead of the budget by scan_every blocks
    assert peak[0] <= budget_blocks + 2 * store.disk.scan_every + 2 * 8
    assert sum(
        s.disk.num_budget_deletes for s in (m.engine.core.offload for m in llms) if s and s.disk
    )


def _unshare_works() -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    r = subprocess.run(["unshare", "-r", "-m", "true"], capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("kind", ["full", "read-only"])
def test_broken_disk_directory_turns_the_tier_off_and_requests_go_on(
    tiny_llama_path: Path, tmp_path: Path, kind: str
) -> None:
    cmd = [sys.executable, str(CHILD), str(tiny_llama_path), str(tmp_path / "disk"), kind]
    if kind == "read-only":
        if not _unshare_works():
            pytest.skip("needs unshare -r -m (user and mount namespaces) for a read-only mount")
        cmd = ["unshare", "-r", "-m", *cmd]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["outs"] == res["expected"]
    disk = res["disk"]
    assert disk["disabled"] == 1 and disk["write_errors"] >= 1
    assert "disk tier off" in r.stderr
