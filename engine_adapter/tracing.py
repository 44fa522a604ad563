"""OpenTelemetry spans of the scheduler side: resolve and pull (lease + NIXL read).

A request's ``kv_transfer_params["trace_context"]`` (W3C ``traceparent``)
makes its spans children of the router's trace. Where spans go follows the
standard OTEL_* variables of the engine's environment
(kvbroker.common.telemetry: OTEL_SERVICE_NAME, OTEL_TRACES_EXPORTER,
OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_EXPORTER_OTLP_ENDPOINT); with nothing to
export to, the global tracer provider is used (a no-op unless the process
configured one). A setting that cannot work is logged and leaves the engine
serving without spans: tracing never stops an engine. Spans are started and ended explicitly because the work they
cover spans several scheduler steps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvbroker.common import telemetry

SERVICE_NAME = "kvbroker-engine-adapter"
TRACER_NAME = "kvbroker.engine_adapter"

log = logging.getLogger("vllm.kvbroker.tracing")

_tracer: Tracer | None = None


def get_tracer() -> Tracer:
    global _tracer
    if _tracer is None:
        try:
            provider = telemetry.tracer_provider(SERVICE_NAME)
        except telemetry.TelemetryError as err:
            log.error("tracing is off: %s", err)
            provider = None
        _tracer = provider.get_tracer(TRACER_NAME) if provider is not None else trace.get_tracer(TRACER_NAME)
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
