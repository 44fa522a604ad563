"""OpenTelemetry spans of the scheduler side: resolve and pull (lease + NIXL read).

A request's ``kv_transfer_params["trace_context"]`` (W3C ``traceparent``)
makes its spans children of the router's trace. Spans are exported over OTLP
when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set in the engine's environment;
otherwise the global tracer provider is used (a no-op unless the process
configured one). Spans are started and ended explicitly because the work they
cover spans several scheduler steps.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SERVICE_NAME = "kvbroker-engine-adapter"

_tracer: Tracer | None = None


def get_tracer() -> Tracer:
    global _tracer
    if _tracer is None:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        if endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
            provider.add_span_processor(BatchSpanProcessor(exporter))
            _tracer = provider.get_tracer("kvbroker.engine_adapter")
        else:
            _tracer = trace.get_tracer("kvbroker.engine_adapter")
    return _tracer


def set_tracer(tracer: Tracer | None) -> None:
    """For tests: use this tracer (None: back to the default)."""
    global _tracer
    _tracer = tracer


def start_span(name: str, carrier: Mapping[str, str] | None, attributes: Mapping[str, Any]) -> Span:
    context = TraceContextTextMapPropagator().extract(dict(carrier)) if carrier else None
    return get_tracer().start_span(name, context=context, attributes=dict(attributes))


def end_span(span: Span | None, attributes: Mapping[str, Any], error: str = "") -> None:
    if span is None:
        return
    for key, value in attributes.items():
        span.set_attribute(key, value)
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def current(span: Span | None) -> AbstractContextManager[Any]:
    """Make ``span`` current while a broker call is issued, so the call joins its trace."""
    if span is None:
        return nullcontext()
    return trace.use_span(span, end_on_exit=False)
