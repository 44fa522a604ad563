"""OpenTelemetry server spans for the unary RPCs, added as an interceptor.

Trace context comes from the call's gRPC metadata (W3C `traceparent`), so a
router's or an engine's trace continues through the broker. Spans go to an
OTLP gRPC exporter when an endpoint is configured (--otlp-endpoint or the
standard OTEL_EXPORTER_OTLP_ENDPOINT); without one nothing is installed.
The Session stream's messages (the engines' fast path) are not traced, except
its lease commands (``command_span``), which are named and parented as their
unary twins so a trace looks the same whichever way the command came.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

SERVICE_NAME = "kvbroker"


def otlp_endpoint(configured: str) -> str:
    return configured or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")


def make_tracer_provider(endpoint: str = "", exporter: SpanExporter | None = None) -> TracerProvider | None:
    """A provider exporting to `exporter`, or to OTLP at `endpoint`; None when neither is given."""
    if exporter is None:
        if not endpoint:
            return None
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class TracingInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, provider: TracerProvider) -> None:
        self._tracer = provider.get_tracer("kvbroker.server")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        full_method: str = handler_call_details.method  # type: ignore[attr-defined]
        service, _, method = full_method.lstrip("/").partition("/")
        inner = handler.unary_unary
        tracer = self._tracer

        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
            with tracer.start_as_current_span(
                full_method.lstrip("/"),
                context=extract(carrier),
                kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                try:
                    return await inner(request, context)
                except BaseException:
                    code = context.code()
                    name = code.name if code is not None else "UNKNOWN"  # type: ignore[union-attr]
                    span.set_attribute("rpc.grpc.status_code", name)
                    span.set_status(Status(StatusCode.ERROR, context.details() or name))  # type: ignore[arg-type]
                    raise

        return grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def command_span(
    tracer: trace.Tracer | None, method: str, carrier: Mapping[str, str]
) -> AbstractContextManager[Any]:
    """A server span for a lease command on the Session stream, named as the unary ``method``.

    Only when tracing is on and the caller sent a trace context (``SessionUp.trace_context``).
    """
    if tracer is None or not carrier:
        return contextlib.nullcontext()
    return tracer.start_as_current_span(
        f"kvbroker.v1.KVBroker/{method}",
        context=extract(dict(carrier)),
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": "kvbroker.v1.KVBroker", "rpc.method": method},
    )


def current_trace_id() -> int:
    return trace.get_current_span().get_span_context().trace_id
