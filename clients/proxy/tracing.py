"""OpenTelemetry for the proxy: one server span per request, context passed on to the engines.

The trace context travels two ways: as W3C `traceparent` HTTP headers to the
engines' OpenAI servers, and inside `kv_transfer_params["trace_context"]`, the
only per-request channel that reaches the engines' KV connectors, so the
adapters' spans (broker calls, NIXL transfers) join the request's trace.
"""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.propagate import inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

SERVICE_NAME = "kvbroker-proxy"

TRACER_NAME = "kvbroker.proxy"


def get_tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """The proxy's tracer from `provider`, or from the global provider (late-bound) when None."""
    return (provider or trace.get_tracer_provider()).get_tracer(TRACER_NAME)


def setup_tracing(endpoint: str = "", exporter: SpanExporter | None = None) -> TracerProvider | None:
    """Install a global provider exporting to `exporter` or OTLP gRPC at `endpoint`; None if neither.

    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are honoured; the service
    name defaults to kvbroker-proxy.
    """
    if exporter is None:
        if not endpoint:
            return None
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def current_context_carrier() -> dict[str, str]:
    """traceparent (and tracestate) of the current span; empty without a recording trace."""
    carrier: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        inject(carrier)
    return carrier
