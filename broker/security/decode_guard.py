"""An interceptor that answers undecodable requests with INVALID_ARGUMENT.

Left alone, grpc.aio reports a protobuf DecodeError as UNKNOWN (and logs a
traceback); bad bytes are bad input and get a precise status like any other
(cause bad_request): unary calls, server streams (Watch, Mirror) and every
message of a bidirectional stream (Session).
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

        if handler.stream_stream is not None:
            if not inspect.iscoroutinefunction(handler.stream_stream):
                return handler  # e.g. reflection's generator handlers: left as they are
            return self._guard_stream(handler, guarded_decode, method)
        if handler.unary_stream is not None:
            if not inspect.isasyncgenfunction(handler.unary_stream):
                return handler
            return self._guard_server_stream(handler, guarded_decode, method)
        if handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request to {method} is not a valid message: {request.reason}",
                    Cause.BAD_REQUEST,
                )
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=guarded_decode, response_serializer=handler.response_serializer
        )

    @staticmethod
    def _guard_server_stream(
        handler: grpc.RpcMethodHandler, guarded_decode: Callable[[bytes], Any], method: str
    ) -> grpc.RpcMethodHandler:
        inner = handler.unary_stream

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request to {method} is not a valid message: {request.reason}",
                    Cause.BAD_REQUEST,
                )
            async for response in inner(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            guarded, request_deserializer=guarded_decode, response_serializer=handler.response_serializer
        )

    @staticmethod
    def _guard_stream(
        handler: grpc.RpcMethodHandler, guarded_decode: Callable[[bytes], Any], method: str
    ) -> grpc.RpcMethodHandler:
        inner = handler.stream_stream

        async def guarded(request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            async def checked() -> AsyncIterator[Any]:
                async for request in request_iterator:
                    if isinstance(request, _Malformed):
                        await abort(
                            context,
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"message on {method} is not a valid message: {request.reason}",
                            Cause.BAD_REQUEST,
                        )
                    yield request

            return await inner(checked(), context)

        return grpc.stream_stream_rpc_method_handler(
            guarded, request_deserializer=guarded_decode, response_serializer=handler.response_serializer
        )
