"""Tracing set up from OpenTelemetry's standard variables, the same way in every process.

The broker, the engine adapter and the proxy each call `tracer_provider(...)`
with their default service name. It reads:

- ``OTEL_SERVICE_NAME`` (then ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``):
  the service name; the program's own default otherwise.
- ``OTEL_TRACES_EXPORTER``: ``otlp`` (default), ``console`` (spans printed on
  stdout), ``none``, or a comma-separated list of the first two.
- ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``:
  ``grpc`` (default) or ``http/protobuf`` (needs the
  ``opentelemetry-exporter-otlp-proto-http`` package).
- ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``
  (a program's own endpoint flag wins): where OTLP goes. Without an endpoint
  the ``otlp`` exporter is off, so a process without tracing set up sends
  nothing anywhere.

A value that cannot work raises `TelemetryError` with what to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")
HTTP_EXPORTER_PACKAGE = "opentelemetry-exporter-otlp-proto-http"
_UNKNOWN_SERVICE = "unknown_service"


class TelemetryError(ValueError):
    """An OTEL_* setting this process cannot follow; the message says what to change."""


@dataclass(frozen=True)
class TraceSettings:
    exporters: tuple[str, ...]
    endpoint: str
    protocol: str
    service_name: str
    # The endpoint is the signal's own URL (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), not a base URL.
    endpoint_is_traces_url: bool = False


def trace_settings(default_service_name: str, endpoint: str = "") -> TraceSettings:
    """What the environment asks for; `endpoint` (a program's own flag) wins over the variables."""
    env = os.environ
    exporters = tuple(
        name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if name.strip()
    ) or ("otlp",)
    unknown = [name for name in exporters if name not in EXPORTERS]
    if unknown:
        raise TelemetryError(
            f"OTEL_TRACES_EXPORTER={env.get('OTEL_TRACES_EXPORTER')!r}: unknown exporter(s) {unknown}; "
            f"use {', '.join(EXPORTERS)}"
        )
    if "none" in exporters:
        exporters = ()
    protocol_var = (
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
        if env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        else "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    protocol = (env.get(protocol_var) or "grpc").strip().lower()
    if "otlp" in exporters and protocol not in PROTOCOLS:
        raise TelemetryError(f"{protocol_var}={protocol!r} is not supported; use {' or '.join(PROTOCOLS)}")
    traces_url = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    chosen = endpoint or traces_url or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    return TraceSettings(
        exporters=exporters,
        endpoint=chosen,
        protocol=protocol,
        service_name=_service_name(default_service_name),
        endpoint_is_traces_url=bool(chosen) and chosen == traces_url and not endpoint,
    )


def _service_name(default: str) -> str:
    """OTEL_SERVICE_NAME, else service.name from OTEL_RESOURCE_ATTRIBUTES, else `default`."""
    detected = str(Resource.create().attributes.get("service.name", ""))
    return detected if detected and not detected.startswith(_UNKNOWN_SERVICE) else default


def tracer_provider(
    default_service_name: str,
    endpoint: str = "",
    *,
    exporter: SpanExporter | None = None,
) -> TracerProvider | None:
    """A provider with the exporters the environment names; None when nothing would be exported.

    `exporter` (tests) replaces the environment's exporters; the service name still follows it.
    """
    settings = trace_settings(default_service_name, endpoint)
    exporters = [exporter] if exporter is not None else _exporters(settings)
    if not exporters:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}))
    for chosen in exporters:
        provider.add_span_processor(BatchSpanProcessor(chosen))
    return provider


def _exporters(settings: TraceSettings) -> list[SpanExporter]:
    out: list[SpanExporter] = []
    if "console" in settings.exporters:
        out.append(ConsoleSpanExporter(service_name=settings.service_name))
    if "otlp" in settings.exporters and settings.endpoint:
        out.append(_otlp_exporter(settings))
    return out


def _otlp_exporter(settings: TraceSettings) -> SpanExporter:
    endpoint = settings.endpoint
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpSpanExporter,
        )
    except ImportError:
        raise TelemetryError(
            f"OTLP over http/protobuf needs the {HTTP_EXPORTER_PACKAGE} package, which is not installed: "
            f"pip install {HTTP_EXPORTER_PACKAGE} (or 'kvbroker[otlp-http]'; or set "
            "OTEL_EXPORTER_OTLP_PROTOCOL=grpc)"
        ) from None
    return HttpSpanExporter(
        endpoint=endpoint if settings.endpoint_is_traces_url else http_traces_url(endpoint)
    )


def http_traces_url(base: str) -> str:
    """The traces URL under an OTLP/HTTP base endpoint (http://collector:4318 -> .../v1/traces)."""
    return base.rstrip("/") + "/v1/traces"
