"""Process-level metrics of a replica: memory, fds and threads, and Python object counts.

A long-running replica should look the same after a day as after a minute; these are the figures
that show it does (and what `deja bench soak` reads): prometheus_client's standard `process_*`
metrics (resident memory, open fds, CPU seconds) and

    deja_python_objects        objects tracked by the garbage collector (len(gc.get_objects()))
    deja_python_threads        live Python threads

Both are computed at scrape time, on the metrics HTTP thread (gc.get_objects() takes a few tens
of milliseconds per million objects).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class PythonObjectsCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "deja_python_objects",
            "Objects tracked by the garbage collector.",
            len(gc.get_objects()),
        )
        yield GaugeMetricFamily(
            "deja_python_threads", "Live Python threads.", threading.active_count()
        )


def register_process_metrics(registry: CollectorRegistry) -> None:
    """Adds the process_* metrics and the Python object / thread gauges to `registry`."""
    ProcessCollector(registry=registry)
    registry.register(PythonObjectsCollector())
