"""The GPU check's dry run: on a machine without a GPU, every step of `verify` is known, every
Python entry point it calls parses, every name the GPU tests import exists, and every file the
steps read is tracked (a GPU machine gets the tree as git sees it, and minutes there are few)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(logs: Path, *steps: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_LOG_DIR": str(logs)}
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", *steps],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_verify_dry_run_passes(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "verify")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dry run: ok" in done.stdout
    for step in ("tests-all", "sanitize-graph", "gpu", "step", "sanitize"):
        assert f"ok    step {step} " in done.stdout


def test_dry_run_refuses_an_unknown_step(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "tests-all", "no-such-step")
    assert done.returncode != 0
    assert "unknown step no-such-step" in done.stdout
