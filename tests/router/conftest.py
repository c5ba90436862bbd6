from __future__ import annotations

from collections.abc import Iterator

import pytest

from .redis_proc import RedisProcess


@pytest.fixture
def redis_proc() -> Iterator[RedisProcess]:
    proc = RedisProcess()
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
