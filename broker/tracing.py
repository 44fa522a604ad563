"""OpenTelemetry server spans for the unary RPCs, added as an interceptor.

Trace context comes from the call's gRPC metadata (W3C `traceparent`), so a
router's or an engine's trace continues through the broker. Where spans go
follows the standard OTEL_* variables (kvbroker.common.telemetry); the
--otlp-endpoint flag wins over OTEL_EXPORTER_OTLP_ENDPOINT. Without an
endpoint or another exporter nothing is installed. Every span carries
`rpc.grpc.status_code`, the status as an integer (0 for OK), as OpenTelemetry's
RPC semantic conventions ask.

The Session stream's messages (the engines' fast path) are not traced, except
its lease commands (``command_span``), which are named and parented as their
unary twins so a trace looks the same whichever way the command came.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvbroker.broker.errors import BrokerError
from kvbroker.broker.status import status_of
from kvbroker.common import telemetry

SERVICE_NAME = "kvbroker"
STATUS_CODE_ATTRIBUTE = "rpc.grpc.status_code"


def make_tracer_provider(endpoint: str = "", exporter: SpanExporter | None = None) -> TracerProvider | None:
    """The broker's provider: OTEL_* variables, `endpoint` winning; None when nothing is exported.

    Raises TelemetryError when the variables ask for something that cannot work."""
    return telemetry.tracer_provider(SERVICE_NAME, endpoint, exporter=exporter)


def set_rpc_status(span: trace.Span, code: grpc.StatusCode, message: str = "") -> None:
    """The status as the semantic conventions want it: an int attribute, always; ERROR unless OK."""
    number: int = code.value[0]
    span.set_attribute(STATUS_CODE_ATTRIBUTE, number)
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, message or code.name))


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
                    response = await inner(request, context)
                except BaseException:
                    code = _code_of(context.code(), grpc.StatusCode.UNKNOWN)
                    set_rpc_status(span, code, str(context.details() or ""))
                    raise
                set_rpc_status(
                    span, _code_of(context.code(), grpc.StatusCode.OK), str(context.details() or "")
                )
                return response

        return grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _code_of(code: Any, default: grpc.StatusCode) -> grpc.StatusCode:
    """The code a handler set (grpc.aio may give a StatusCode, an int or None)."""
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        return next((c for c in grpc.StatusCode if c.value[0] == code), default)
    return default


@contextlib.contextmanager
def command_span(tracer: trace.Tracer | None, method: str, carrier: Mapping[str, str]) -> Iterator[None]:
    """A server span for a lease command on the Session stream, named as the unary ``method``.

    Only when tracing is on and the caller sent a trace context (``SessionUp.trace_context``).
    A BrokerError leaving the block sets the status its unary twin would answer with.
    """
    if tracer is None or not carrier:
        yield
        return
    with tracer.start_as_current_span(
        f"kvbroker.v1.KVBroker/{method}",
        context=extract(dict(carrier)),
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": "kvbroker.v1.KVBroker", "rpc.method": method},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield
        except BrokerError as err:
            set_rpc_status(span, status_of(err), err.message)
            raise
        set_rpc_status(span, grpc.StatusCode.OK)
