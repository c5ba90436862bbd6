"""Shared fixtures: tiny random checkpoints built offline, and the converted demo model."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# `deja serve` defaults to --dtype auto (bfloat16 on CPUs with bf16 units); the servers the tests
# start compute in float32 on every CI machine, so their outputs do not depend on its CPU.
os.environ.setdefault("DEJA_DTYPE", "float32")

# Makes `engine.testing.tiny_models` importable without a `pythonpath` pytest setting.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pytest  # noqa: E402

from engine.testing.tiny_models import FAMILY_BUILDERS, build_tiny_llama, build_tiny_qwen2  # noqa: E402
from tests.support.redis_proc import RedisProcess  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random 2-layer Llama (GQA 4/2, untied embeddings) with the tiny BPE tokenizer."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random 2-layer Qwen2 (q/k/v bias, tied embeddings) with the tiny BPE tokenizer."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """family name (a key of engine.testing.tiny_models.FAMILY_BUILDERS) -> its tiny random checkpoint,
    built once per session."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = FAMILY_BUILDERS[family](tmp_path_factory.mktemp(f"tiny-{family}"))
        return built[family]

    return get


@pytest.fixture(scope="session")
def demo_model_path() -> Path:
    """SmolLM2-135M-Instruct converted once into $DEJA_CACHE_DIR (default ~/.cache/deja)."""
    from engine.demo import ensure_demo_model

    cache_dir = Path(os.environ.get("DEJA_CACHE_DIR") or Path.home() / ".cache" / "deja")
    try:
        return ensure_demo_model(cache_dir)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def redis_proc() -> Iterator[RedisProcess]:
    """A throwaway redis-server on a free port (the real server, from Debian)."""
    proc = RedisProcess()
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
