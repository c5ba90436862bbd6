"""OpenTelemetry tracing for the replica: provider setup and the per-request span.

`make_tracer_provider` builds a TracerProvider that exports OTLP when an endpoint is configured,
prints spans on request, and is None otherwise (the server then uses a no-op tracer). The provider
is passed around, never installed globally, so tests can hand in one with an in-memory exporter.

One span per Generate call, a child of the W3C `traceparent` in the call metadata, named
`{operation} {model}` with gen_ai.* attributes (OpenTelemetry GenAI semantic conventions) and
deja.* extras; events "scheduled", "first_token" and "finished" carry the engine's timestamps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.outputs import RequestOutput
from engine.sample.sampling_params import SamplingParams

TRACER_NAME = "deja.service"
_PROPAGATOR = TraceContextTextMapPropagator()


def make_tracer_provider(
    *,
    service_name: str = "deja",
    replica_id: str = "",
    otlp_endpoint: str | None = None,
    console: bool = False,
) -> TracerProvider | None:
    """A provider with the configured exporters, or None when nothing would be exported."""
    if not otlp_endpoint and not console:
        return None
    attrs: dict[str, Any] = {"service.name": service_name}
    if replica_id:
        attrs["service.instance.id"] = replica_id
    provider = TracerProvider(resource=Resource.create(attrs))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not otlp_endpoint.startswith("https://")
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=insecure))
        )
    if console:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    return provider


def get_tracer(provider: trace.TracerProvider | None) -> Tracer:
    """The provider's tracer, or a no-op tracer when tracing is off."""
    if provider is None:
        return trace.NoOpTracer()
    return provider.get_tracer(TRACER_NAME)


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The W3C trace context (traceparent/tracestate) carried in gRPC call metadata."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            carrier[key.lower()] = value
    return _PROPAGATOR.extract(carrier)


def inject_context(span: Span, metadata: list[tuple[str, str]]) -> None:
    """Appends `span`'s W3C context to outgoing call metadata (client side)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    metadata.extend(carrier.items())


def _epoch_ns(monotonic_t: float) -> int:
    """A time.monotonic() timestamp converted to epoch nanoseconds (what spans use)."""
    return time.time_ns() - int((time.monotonic() - monotonic_t) * 1e9)


def start_request_span(
    tracer: Tracer,
    *,
    parent: Context,
    operation: str,
    model: str,
    request_id: str,
    params: SamplingParams,
    replica_id: str,
    tenant: str | None,
) -> Span:
    """Starts the server span of one Generate call (ended by `end_request_span`)."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.system": "deja",
        "gen_ai.request.model": model,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.choice.count": params.n,
        "gen_ai.response.id": request_id,
        "rpc.system": "grpc",
        "rpc.service": "deja.v1.Inference",
        "rpc.method": "Generate",
        "deja.request_id": request_id,
        "deja.replica_id": replica_id,
    }
    if params.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = params.max_tokens
    if params.top_k:
        attrs["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = params.seed
    if tenant is not None:
        attrs["deja.tenant"] = tenant
    return tracer.start_span(
        f"{operation} {model}", context=parent, kind=SpanKind.SERVER, attributes=attrs
    )


def end_request_span(
    span: Span,
    final: RequestOutput | None,
    *,
    completion_tokens: int,
    finish_reasons: list[str],
    error: str | None = None,
) -> None:
    """Records usage, cache and timing attributes and events from the last output; ends the span."""
    if final is not None:
        cached = final.cached_tokens
        attrs: Mapping[str, Any] = {
            "gen_ai.usage.input_tokens": len(final.prompt_token_ids),
            "gen_ai.usage.output_tokens": completion_tokens,
            "gen_ai.response.finish_reasons": finish_reasons,
            "deja.cached_prompt_tokens": final.num_cached_tokens,
            "deja.cached_prompt_tokens.device": cached.device,
            "deja.cached_prompt_tokens.cpu": cached.cpu,
            "deja.cached_prompt_tokens.disk": cached.disk,
            "deja.cached_prompt_tokens.remote": cached.remote,
        }
        span.set_attributes(attrs)
        if final.pinned is not None:
            span.set_attribute("deja.pinned", final.pinned)
        m = final.metrics
        if m is not None:
            if m.queue_time is not None:
                span.set_attribute("deja.queue_time_s", m.queue_time)
            if m.ttft is not None:
                span.set_attribute("deja.ttft_s", m.ttft)
            if m.e2e is not None:
                span.set_attribute("deja.e2e_s", m.e2e)
            if m.num_spec_steps:
                span.set_attribute("deja.spec_decode.draft_tokens", m.num_draft_tokens)
                span.set_attribute("deja.spec_decode.accepted_tokens", m.num_accepted_tokens)
                span.set_attribute("deja.spec_decode.verify_steps", m.num_spec_steps)
            for name, t in (
                ("scheduled", m.first_scheduled),
                ("first_token", m.first_token),
                ("finished", m.finished),
            ):
                if t is not None:
                    span.add_event(name, timestamp=_epoch_ns(t))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()
