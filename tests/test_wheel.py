"""The wheel is complete: built from the checkout, installed into a fresh venv and run from a
folder outside the checkout, its `deja serve` serves a tiny model and answers a Generate from
its own client, and the C++ and CUDA sources the kernels build from on first use are in it. On
SIGTERM the server stops with its own log lines only.

The fresh venv sees the test environment's site-packages for the dependencies (a `.pth` line;
tests/test_packaging.py checks that every import is a declared dependency, and no download is
possible here), never the checkout: the editable install's hook lives in a `.pth` file of that
folder, which a path line does not run, and the test asserts where `engine` is imported from.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.service.serving import wait_serving

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.timeout(600)
def test_the_wheel_serves_from_a_fresh_venv(tiny_llama_path: Path, tmp_path: Path) -> None:
    # Built from a copy of the files git would commit, so nothing ignored (an old build/ folder,
    # caches) goes into the wheel and the checkout stays untouched.
    src = tmp_path / "src"
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split("\n")  # fmt: skip
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "--quiet", "-w", str(dist)],
        check=True,
    )  # fmt: skip
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [str(py), "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)], check=True
    )
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    where = subprocess.run(
        [str(py), "-c", "import engine, pathlib; print(pathlib.Path(engine.__file__).parent)"],
        cwd=away, env=env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    installed = Path(where)
    assert installed.is_relative_to(site), f"engine imported from {where}, not the wheel"
    for source in ("engine/worker/attention/cpu_paged_attention.cpp", "cuda/paged_attention.cu"):
        assert (installed.parent / source).is_file(), f"{source} is not in the wheel"

    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(venv / "bin" / "deja"), "serve", "--model", str(tiny_llama_path),
             "--port", str(port), "--num-device-blocks", "64", "--cpu-swap-gib", "0"],
            cwd=away, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_serving(proc, f"127.0.0.1:{port}", log)
        client = (
            "from clients.client import DejaClient\n"
            f"c = DejaClient('127.0.0.1:{port}', retries=0)\n"
            "r = c.complete([11, 12, 13, 14], max_tokens=5, temperature=0, ignore_eos=True,"
            " return_token_ids=True)\n"
            "print(len(r.choices[0].token_ids))\n"
        )
        got = subprocess.run(
            [str(py), "-c", client], cwd=away, env=env, check=True, capture_output=True, text=True
        )
        assert got.stdout.strip() == "5"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()
    # A clean stop prints the server's own log lines and nothing else (no teardown noise).
    text = log.read_text()
    assert "nanobind" not in text and "leaked" not in text, text[-2000:]
    assert all(" INFO " in line or " WARNING " in line for line in text.splitlines()), text
