"""A child process for the disk-tier crash and fault tests (run as a script, not collected).

python tests/engine/kv_io/tier_child.py MODEL DISK_DIR crash
    Serves prompts `rand_tokens(256, i)` for i = 0, 1, ... with write-through until killed;
    prints "done i" after each request.
python tests/engine/kv_io/tier_child.py MODEL DISK_DIR full|read-only
    Serves 4 prompts, then breaks the disk directory (full: RLIMIT_FSIZE below one block
    file, so writes fail with EFBIG; read-only: a read-only bind mount, when run inside
    `unshare -r -m`), serves 6 more, and prints one JSON line: outputs, reference outputs
    (caching off) and the disk tier's stats.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import signal
import subprocess
import sys

from engine import LLM, SamplingParams
from tests.support.prompts import rand_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def write_through_llm(model: str, disk_dir: str, device_blocks: int, cpu_blocks: int) -> LLM:
    """An engine whose disk tier (at `disk_dir`) is written through."""
    return LLM(
        model,
        dtype="float32",
        block_size=16,
        num_device_blocks=device_blocks,
        num_cpu_blocks=cpu_blocks,
        disk_dir=disk_dir,
        disk_write_policy="write-through",
    )


def crash(model: str, disk_dir: str) -> None:
    llm = write_through_llm(model, disk_dir, device_blocks=64, cpu_blocks=16)
    i = 0
    while True:
        llm.generate([rand_tokens(256, i)], GREEDY)
        print(f"done {i}", flush=True)
        i += 1


def fault(model: str, disk_dir: str, kind: str) -> None:
    ref = LLM(model, dtype="float32", block_size=16, num_device_blocks=256, num_cpu_blocks=0)
    llm = write_through_llm(model, disk_dir, device_blocks=32, cpu_blocks=8)
    prompts = [rand_tokens(160, 500 + i % 5) + rand_tokens(8, i) for i in range(10)]
    outs: list[list[int]] = []
    for i, p in enumerate(prompts):
        if i == 4:
            assert llm.engine.core.offload is not None
            llm.engine.core.offload.flush()
            if kind == "full":
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
                resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
            else:
                subprocess.run(["mount", "--bind", disk_dir, disk_dir], check=True)
                subprocess.run(["mount", "-o", "remount,bind,ro", disk_dir], check=True)
        outs.append(llm.generate([p], GREEDY)[0].token_ids)
    expected = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    disk = next(t for t in llm.engine.get_stats().tiers if t.name == "disk")
    llm.engine.close(timeout_s=5.0)
    print(json.dumps({"outs": outs, "expected": expected, "disk": dataclasses.asdict(disk)}))


if __name__ == "__main__":
    model_path, directory, mode = sys.argv[1:4]
    if mode == "crash":
        crash(model_path, directory)
    else:
        fault(model_path, directory, mode)
