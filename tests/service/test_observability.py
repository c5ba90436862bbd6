"""Acceptance 5: the client span is the parent of the server span, which carries the gen_ai.*
attributes and events; the Prometheus endpoint is scraped over HTTP."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from service.common.tracing import extract_context, make_tracer_provider
from tests.service.conftest import Harness, StartServer, make_engine
from tests.support.waiting import wait_until


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def _spans(exporter: InMemorySpanExporter, n: int = 1) -> tuple[ReadableSpan, ...]:
    await wait_until(lambda: len(exporter.get_finished_spans()) >= n, 5, what="finished spans")
    return exporter.get_finished_spans()


async def test_client_span_is_parent_of_server_span(start_server: StartServer) -> None:
    server_provider, server_spans = _provider()
    client_provider, client_spans = _provider()
    h = await start_server(tracer_provider=server_provider, client_tracer_provider=client_provider)
    result = await h.client.complete(
        "The capital of France is", request_id="trace-me", max_tokens=5, temperature=0.5, top_p=0.9
    )
    [client] = await _spans(client_spans)
    [server] = await _spans(server_spans)

    assert client.kind == SpanKind.CLIENT and server.kind == SpanKind.SERVER
    assert server.parent is not None
    assert server.context.trace_id == client.context.trace_id
    assert server.parent.span_id == client.context.span_id

    model = h.engine.model_info.model_id
    assert server.name == f"text_completion {model}"
    a = server.attributes or {}
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == model
    assert a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.response.id"] == "trace-me"
    assert a["gen_ai.usage.input_tokens"] == result.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == 5
    assert list(a["gen_ai.response.finish_reasons"]) == ["length"]  # type: ignore[arg-type]
    assert a["deja.cached_prompt_tokens"] == result.usage.cached_prompt_tokens
    for tier in ("device", "cpu", "disk"):
        assert f"deja.cached_prompt_tokens.{tier}" in a
    assert a["deja.queue_time_s"] == pytest.approx(result.timings.queue_s)
    assert a["deja.ttft_s"] == pytest.approx(result.timings.ttft_s)
    events = [e.name for e in server.events]
    assert events == ["scheduled", "first_token", "finished"]
    stamps = [e.timestamp for e in server.events]
    assert stamps == sorted(stamps)
    assert server.start_time is not None and server.end_time is not None
    assert server.start_time - 50_000_000 <= stamps[0] <= server.end_time + 50_000_000
    assert (client.attributes or {})["gen_ai.usage.output_tokens"] == 5


async def test_cancelled_request_span_is_an_error(start_server: StartServer) -> None:
    provider, spans = _provider()
    h = await start_server(tracer_provider=provider)
    async for _ in h.client.generate("Once upon a time", max_tokens=900, ignore_eos=True):
        break
    [span] = await _spans(spans)
    assert not span.status.is_ok
    await h.assert_clean()


def test_tracer_provider_setup() -> None:
    assert make_tracer_provider() is None  # nothing configured: no SDK work at all
    assert make_tracer_provider(console=True) is not None
    otlp = make_tracer_provider(otlp_endpoint="http://127.0.0.1:4317", replica_id="r1")
    assert otlp is not None
    assert otlp.resource.attributes["service.instance.id"] == "r1"
    otlp.shutdown()
    from opentelemetry import trace

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ctx = extract_context([("traceparent", parent), ("other", "x")])
    sc = trace.get_current_span(ctx).get_span_context()
    assert sc.trace_id == 0x0AF7651916CD43DD8448EB211C80319C and sc.is_remote


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model")
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


async def test_metrics_endpoint(start_server: StartServer, server: Harness) -> None:
    assert server.replica.metrics_port is None  # off by default
    h = await start_server(metrics_port=0)
    assert h.replica.metrics_port
    prompt = "Cats and dogs are common pets; birds sing in the morning. " * 3
    for _ in range(2):
        await h.client.complete(prompt, max_tokens=4, temperature=0)
    with pytest.raises(grpc.aio.AioRpcError):
        await h.client.complete("", max_tokens=4)
    port = h.replica.metrics_port
    assert port is not None
    m: dict[str, float] = {}

    async def refreshed() -> bool:  # a monitor tick after the last request refreshed them
        m.update(await asyncio.to_thread(_scrape, port))
        hits = m.get("deja_prefix_cache_hits_total{}", 0)
        return hits >= 16 and m.get("deja_num_requests_running{}") == 0

    await wait_until(refreshed, what="the engine gauges")

    assert m["deja_requests_total{outcome=length}"] >= 2
    assert m["deja_requests_total{outcome=invalid_argument}"] >= 1
    assert m["deja_generation_tokens_total{}"] >= 8
    assert m["deja_prompt_tokens_total{}"] > 0
    assert m["deja_cached_prompt_tokens_total{tier=device}"] >= 16  # the second prompt hit
    for hist in (
        "deja_time_to_first_token_seconds",
        "deja_e2e_request_latency_seconds",
        "deja_request_queue_time_seconds",
    ):
        assert m[f"{hist}_count{{}}"] >= 2
    assert m["deja_inter_token_latency_seconds_count{}"] >= 6
    assert m["deja_num_requests_running{}"] == 0
    assert m["deja_num_requests_waiting{}"] == 0
    assert 0.0 <= m["deja_kv_cache_usage_ratio{}"] <= 1.0
    assert m["deja_prefix_cache_queries_total{}"] > 0
    assert m["deja_prefix_cache_hits_total{}"] >= 16
    assert m["deja_cache_tier_blocks{state=total,tier=device}"] == 512
    assert m["deja_active_streams{}"] == 0
    # two requests of 4 tokens: at least a prefill and 3 decodes each, every step timed
    assert m["deja_engine_steps_total{}"] >= 8
    assert 0.0 < m["deja_engine_busy_seconds_total{}"] < 60.0


async def test_host_buffers_in_cache_stats_and_metrics(
    start_server: StartServer, tiny_llama_path: Path, tmp_path: Path
) -> None:
    """With the CPU and disk tiers on, GetCacheStats and /metrics list the engine's bounded host
    buffers with their sizes and caps."""
    engine = make_engine(tiny_llama_path, num_cpu_blocks=16, disk_dir=str(tmp_path / "disk"))
    try:
        h = await start_server(engine, metrics_port=0)
        await h.client.complete(list(range(10, 110)), max_tokens=2)
        stats = await h.client.cache_stats()
        buffers = {b.name: b for b in stats.buffers}
        assert set(buffers) == {"cpu_tier", "disk_read_cache", "disk_write_queue"}
        cpu = buffers["cpu_tier"]
        assert cpu.entries == cpu.max_entries == 16 and cpu.bytes == cpu.max_bytes > 0
        for b in buffers.values():
            assert b.max_entries >= 1
            assert 0 <= b.bytes <= b.max_bytes and 0 <= b.entries <= b.max_entries
        assert h.replica.metrics_port
        port = h.replica.metrics_port

        async def gauges_set() -> bool:  # monitor ticks refresh the engine gauges
            scraped = await asyncio.to_thread(_scrape, port)
            return (
                scraped.get("deja_cache_buffer_bytes{buffer=cpu_tier,state=max}") == cpu.max_bytes
            )

        await wait_until(gauges_set, what="the buffer gauges")
        m = await asyncio.to_thread(_scrape, port)
        assert m["deja_cache_buffer_bytes{buffer=cpu_tier,state=max}"] == cpu.max_bytes
        assert m["deja_cache_buffer_blocks{buffer=disk_write_queue,state=max}"] == (
            buffers["disk_write_queue"].max_entries
        )
        assert m["deja_cache_buffer_bytes{buffer=disk_read_cache,state=used}"] >= 0
    finally:
        engine.shutdown(0.0)
