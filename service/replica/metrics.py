"""Prometheus metrics of one replica, on their own registry and HTTP port (off by default).

Per-request metrics are recorded by the servicer as streams progress; engine-wide gauges and
counters (running, waiting, KV usage, prefix-cache queries and hits, per-tier blocks) come from
the latest `engine.get_stats()` snapshot, which the server refreshes periodically on its event
loop and the collector reads at scrape time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.stats import EngineStats
from service.common.metrics_http import MetricsEndpoint
from service.common.process_metrics import register_process_metrics

OUTCOMES = (
    "stop",
    "length",
    "abort",
    "error",
    "cancelled",
    "deadline_exceeded",
    "invalid_argument",
    "unauthenticated",
    "rejected_queue_full",
    "rejected_draining",
    "rejected_engine_dead",
    "stream_overflow",
    "engine_dead",
    "internal",
)
"""Values of the `outcome` label of deja_requests_total."""

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineStatsCollector(Collector):
    def __init__(self, model: str) -> None:
        self._model = model
        self._lock = threading.Lock()
        self._stats: EngineStats | None = None

    def set(self, stats: EngineStats) -> None:
        with self._lock:
            self._stats = stats

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            s = self._stats
        if s is None:
            return
        m = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model"])
            c.add_metric(m, value)
            return c

        yield gauge("deja_num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("deja_num_requests_waiting", "Requests in the engine queue.", s.num_waiting)
        yield gauge("deja_kv_cache_usage_ratio", "Device KV blocks in use (0-1).", s.kv_usage)
        yield gauge("deja_free_device_blocks", "Device KV blocks free.", s.free_device_blocks)
        yield counter("deja_num_preemptions", "Preempted requests.", s.num_preemptions)
        yield counter(
            "deja_engine_busy_seconds", "Wall seconds the engine spent in steps.", s.busy_seconds
        )
        yield counter("deja_engine_steps", "Engine steps.", s.num_steps)
        yield counter(
            "deja_prefix_cache_queries", "Prompt tokens looked up in the cache.", s.prefix_queries
        )
        yield counter("deja_prefix_cache_hits", "Prompt tokens served from cache.", s.prefix_hits)
        if s.spec is not None:  # vLLM's spec_decode counters
            sp = s.spec
            yield counter("deja_spec_decode_num_drafts", "Proposals verified.", sp.num_drafts)
            yield counter(
                "deja_spec_decode_num_draft_tokens", "Tokens proposed.", sp.num_draft_tokens
            )
            yield counter(
                "deja_spec_decode_num_accepted_tokens",
                "Proposed tokens accepted.",
                sp.num_accepted_tokens,
            )
            per_pos = CounterMetricFamily(
                "deja_spec_decode_num_accepted_tokens_per_pos",
                "Accepted proposed tokens by position in the proposal (0: the first).",
                labels=["model", "position"],
            )
            for pos, n in enumerate(sp.accepted_per_pos):
                per_pos.add_metric([*m, str(pos)], n)
            yield per_pos
        blocks = GaugeMetricFamily(
            "deja_cache_tier_blocks", "Blocks per cache tier and state.", labels=["tier", "state"]
        )
        tier_counters = {
            name: CounterMetricFamily(f"deja_cache_tier_{name}", doc, labels=["tier"])
            for name, doc in (
                ("queries", "Prompt tokens looked up in the tier."),
                ("hits", "Prompt tokens served from the tier."),
                ("spills", "Blocks copied to the next tier before reuse."),
                ("swap_ins", "Blocks brought back to the device."),
                ("evictions", "Cached blocks dropped."),
                ("bytes_moved", "Bytes copied in or out of the tier."),
                ("dropped_writes", "Blocks the write policy dropped (writer queue full)."),
                ("write_errors", "Writes into the tier that failed."),
            )
        }
        disabled = GaugeMetricFamily(
            "deja_cache_tier_disabled",
            "1 when the tier is off after a failure (disk: read-only or full; remote: the store "
            "failed and is left alone for a while).",
            labels=["tier"],
        )
        remote_misses = CounterMetricFamily(
            "deja_kv_remote_misses",
            "Remote-tier lookups that ended on an unusable value or a failure, by reason "
            "(truncated, format, foreign, other_block, checksum, error).",
            labels=["reason"],
        )
        for t in s.tiers:
            blocks.add_metric([t.name, "total"], t.num_blocks)
            blocks.add_metric([t.name, "used"], t.used_blocks)
            blocks.add_metric([t.name, "cached"], t.cached_blocks)
            blocks.add_metric([t.name, "pinned"], t.pinned_blocks)
            for name, fam in tier_counters.items():
                fam.add_metric([t.name], getattr(t, name))
            disabled.add_metric([t.name], t.disabled)
            for reason, n in t.misses.items():
                remote_misses.add_metric([reason], n)
        buffer_bytes = GaugeMetricFamily(
            "deja_cache_buffer_bytes",
            "Host bytes held by a bounded engine buffer (cpu_tier, disk_read_cache, "
            "disk_write_queue, remote_buffer, remote_write_queue); state: used or max.",
            labels=["buffer", "state"],
        )
        buffer_entries = GaugeMetricFamily(
            "deja_cache_buffer_blocks",
            "Blocks held by a bounded engine buffer; state: used or max.",
            labels=["buffer", "state"],
        )
        for b in s.buffers:
            buffer_bytes.add_metric([b.name, "used"], b.bytes)
            buffer_bytes.add_metric([b.name, "max"], b.max_bytes)
            buffer_entries.add_metric([b.name, "used"], b.entries)
            buffer_entries.add_metric([b.name, "max"], b.max_entries)
        yield blocks
        yield disabled
        yield remote_misses
        yield from tier_counters.values()
        yield buffer_bytes
        yield buffer_entries


class ServiceMetrics(MetricsEndpoint):
    """The replica's metrics; `start_http` serves them in the Prometheus text format."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.requests = self.counter("deja_requests", "Generate calls by outcome.", ["outcome"])
        self.prompt_tokens = self.counter("deja_prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = self.counter("deja_generation_tokens", "Tokens generated.")
        self.cached_prompt_tokens = self.counter(
            "deja_cached_prompt_tokens", "Prompt tokens served from a cache tier.", ["tier"]
        )
        self.ttft = self.histogram(
            "deja_time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = self.histogram(
            "deja_inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        )
        self.e2e = self.histogram(
            "deja_e2e_request_latency_seconds", "Request latency, arrival to finish.", _E2E_BUCKETS
        )
        self.queue_time = self.histogram(
            "deja_request_queue_time_seconds",
            "Time waiting before first scheduled.",
            _LATENCY_BUCKETS,
        )
        self.active_streams = self.gauge("deja_active_streams", "Open Generate streams.")
        self.queued_streams = self.gauge(
            "deja_queued_streams", "Streams admitted but without a first token."
        )
        self._engine = _EngineStatsCollector(model)
        self.registry.register(self._engine)
        register_process_metrics(self.registry)

    def update_engine_stats(self, stats: EngineStats) -> None:
        self._engine.set(stats)
