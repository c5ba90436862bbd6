"""The emulated kernel tests need g++ (scripts/install.sh --dev installs it). Without it they skip
on a developer's machine; under CI=true they run and fail, so a CI image without g++ cannot pass
quietly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.cuda_emu.emulator import Emulator, find_compiler


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if find_compiler() is not None or os.environ.get("CI", "").lower() in ("true", "1"):
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="g++ is not installed (scripts/install.sh --dev installs it)")
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(skip)


@pytest.fixture
def emu(emulator: Emulator, monkeypatch: pytest.MonkeyPatch) -> Emulator:
    """The module's `emulator` (its kernels compiled once) installed for one test: the CuPy
    launches of that test run on the CPU."""
    emulator.install(monkeypatch)
    emulator.launches.clear()
    return emulator
