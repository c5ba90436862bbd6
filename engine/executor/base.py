"""The executor: the engine core's one handle on the workers (vLLM V1's Executor).

`Executor` runs every rank's `Worker` (engine/worker/worker.py). Rank 0's worker, the `driver`,
lives in this process: the core launches and collects each step through it, and it alone
samples. With one rank that is all (`UniProcExecutor`); with N > 1 `MultiprocExecutor`
(engine/executor/multiproc.py) also starts ranks 1..N-1 in processes of their own, which the
driver's runner sends each step before its own forward.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.config import EngineConfig
from engine.kv_io.offload import KVOffload
from engine.worker.attention.kv_quant import KVScales
from engine.worker.model_runner import ModelRunner, StepHandle, StepOutput
from engine.worker.step_record import StepRecord
from engine.worker.worker import Worker


class Executor:
    """The workers of one engine; rank 0's (`driver`) in this process."""

    driver: Worker
    world: int = 1
    on_death: Callable[[str], None] | None = None
    """Called once, from a watch thread, with the message of a worker's death (N > 1)."""

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (ranks 1..N-1)."""
        return []

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner."""
        runner = self.driver.runner
        assert runner is not None, "the driver's runner is made once the KV cache is allocated"
        return runner

    def launch(self, record: StepRecord, in_flight: StepHandle | None = None) -> StepHandle:
        """Runs one step on every rank; returns before rank 0's sampled ids are on the host."""
        return self.runner.launch(record, in_flight)

    def collect(self, handle: StepHandle) -> StepOutput:
        """The launched step's sampled tokens on the host."""
        return self.runner.collect(handle)

    @property
    def peers_calibrate(self) -> Callable[[list[list[int]]], None] | None:
        """Starts the fp8 calibration pass on ranks 1..N-1 (None: no other ranks)."""
        return None

    def allocate_followers(
        self, num_device_blocks: int, num_cpu_blocks: int, offload: KVOffload | None,
        kv_scales: KVScales | None,
    ) -> None:  # fmt: skip
        """Ranks 1..N-1 allocate their caches as rank 0 did (nothing with one rank)."""

    def dead_worker(self, timeout_s: float) -> str | None:
        """Why a step failed, when a worker died (N > 1); None when every worker lives."""
        return None

    def close(self) -> None:
        """Stops the driver's helpers (and the other ranks)."""
        self.driver.close()


class UniProcExecutor(Executor):
    """One rank, in this process."""

    def __init__(self, config: EngineConfig) -> None:
        self.driver = Worker(config)
