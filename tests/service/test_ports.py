"""`service.common.ports.free_port`: ports the kernel will not hand to another socket meanwhile."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from service.common import ports


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == 50
    assert all(1024 <= p < low for p in got)
    for p in got[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    try:
        # Make every draw land on the busy port: after 200 failed draws, an ephemeral port.
        monkeypatch.setattr(ports._rng, "randint", lambda a, b: busy)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: busy + 1)
        port = ports.free_port()
        assert port != busy
    finally:
        taken.close()


def test_unreadable_range_falls_back_to_the_linux_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert ports._ephemeral_low() == 32768
    (tmp_path / "bad").write_text("x\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "bad")
    assert ports._ephemeral_low() == 32768
