"""An interceptor that answers undecodable requests with INVALID_ARGUMENT.

Left alone, grpc.aio reports a protobuf DecodeError as UNKNOWN (and logs a
traceback); bad bytes are bad input and get a precise status like any other
(cause bad_request): unary calls, server streams (Watch, Mirror, and the health
service's Watch, which writes with context.write) and every message of a
bidirectional stream (Session, and reflection's ServerReflectionInfo, an async
generator): every service the server answers, whatever shape its handler has.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvbroker.broker.status import abort
from kvbroker.common.causes import Cause


class _Malformed:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


async def _refuse(context: grpc.aio.ServicerContext, what: str, reason: str) -> None:
    await abort(
        context,
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{what} is not a valid message: {reason}",
        Cause.BAD_REQUEST,
    )


def _same_shape(
    inner: Callable[..., Any], prelude: Callable[[Any, Any], Awaitable[Any]]
) -> Callable[..., Any]:
    """A handler shaped as `inner` (async generator or coroutine) that awaits
    `prelude(request, context)` (which aborts on a malformed request or returns
    what to pass on) before handing over to `inner`."""
    if inspect.isasyncgenfunction(inner):

        async def generator(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in inner(await prelude(request, context), context):
                yield response

        return generator

    async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await inner(await prelude(request, context), context)

    return coroutine


def _writing(inner: Callable[..., Any], prelude: Callable[[Any, Any], Awaitable[Any]]) -> Callable[..., Any]:
    """`_same_shape`, but an async generator's answers written here with context.write: when
    the client went away with answers still unsent (reflection's answers to a burst of
    requests it never read), the failed write ends the call quietly; left to grpc, each
    such call logged an ExecuteBatchError traceback."""
    if not inspect.isasyncgenfunction(inner):
        return _same_shape(inner, prelude)

    async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
        async for response in inner(await prelude(request, context), context):
            try:
                await context.write(response)
            except Exception:  # grpc's ExecuteBatchError: the stream is gone, nobody to tell
                return

    return writer


def _async(fn: Callable[..., Any] | None) -> bool:
    return fn is not None and (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn))


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer
        method: str = handler_call_details.method  # type: ignore[attr-defined]

        def guarded_decode(data: bytes) -> Any:
            try:
                return decode(data)
            except DecodeError as err:
                return _Malformed(str(err))

        async def checked_request(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await _refuse(context, f"request to {method}", request.reason)
            return request

        async def checked_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            async def checked() -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, _Malformed):
                        await _refuse(context, f"message on {method}", request.reason)
                    yield request

            return checked()

        serialize = handler.response_serializer
        if handler.stream_stream is not None:
            if not _async(handler.stream_stream):
                return handler  # a synchronous handler: not one grpc.aio runs here
            return grpc.stream_stream_rpc_method_handler(
                _writing(handler.stream_stream, checked_stream),
                request_deserializer=guarded_decode,
                response_serializer=serialize,
            )
        if handler.unary_stream is not None:
            if not _async(handler.unary_stream):
                return handler
            return grpc.unary_stream_rpc_method_handler(
                _same_shape(handler.unary_stream, checked_request),
                request_deserializer=guarded_decode,
                response_serializer=serialize,
            )
        if handler.unary_unary is None or not _async(handler.unary_unary):
            return handler
        return grpc.unary_unary_rpc_method_handler(
            _same_shape(handler.unary_unary, checked_request),
            request_deserializer=guarded_decode,
            response_serializer=serialize,
        )
