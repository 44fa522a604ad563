"""OpenTelemetry for the proxy: one server span per request, context passed on to the engines.

The trace context travels two ways: as W3C `traceparent` HTTP headers to the
engines' OpenAI servers, and inside `kv_transfer_params["trace_context"]`, the
only per-request channel that reaches the engines' KV connectors, so the
adapters' spans (broker calls, NIXL transfers) join the request's trace.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.propagate import inject
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter

from kvbroker.common import telemetry

SERVICE_NAME = "kvbroker-proxy"

TRACER_NAME = "kvbroker.proxy"


def get_tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """The proxy's tracer from `provider`, or from the global provider (late-bound) when None."""
    return (provider or trace.get_tracer_provider()).get_tracer(TRACER_NAME)


def setup_tracing(endpoint: str = "", exporter: SpanExporter | None = None) -> TracerProvider | None:
    """Install a global provider as the OTEL_* variables say (`endpoint` winning); None if nothing is exported.

    The service name defaults to kvbroker-proxy (kvbroker.common.telemetry lists
    the variables). Raises TelemetryError for a setting that cannot work.
    """
    provider = telemetry.tracer_provider(SERVICE_NAME, endpoint, exporter=exporter)
    if provider is not None:
        trace.set_tracer_provider(provider)
    return provider


def current_context_carrier() -> dict[str, str]:
    """traceparent (and tracestate) of the current span; empty without a recording trace."""
    carrier: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        inject(carrier)
    return carrier
