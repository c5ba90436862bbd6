"""The engine core's handle on its workers: one rank in this process, or N ranks in N processes.

base.py        `Executor`, `UniProcExecutor` (one rank)
multiproc.py   `MultiprocExecutor`: ranks 1..N-1 in worker processes, rank 0 here
"""

from engine.config import EngineConfig
from engine.executor.base import Executor, UniProcExecutor
from engine.executor.multiproc import MultiprocExecutor

__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    """The executor for config.tensor_parallel_size ranks (each loads its shard here)."""
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(config)
    return MultiprocExecutor(config)
