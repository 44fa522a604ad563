"""An interceptor that answers undecodable unary requests with INVALID_ARGUMENT.

Left alone, grpc.aio reports a protobuf DecodeError as UNKNOWN; bad bytes are
bad input and get a precise status like any other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


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
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer
        inner = handler.unary_unary
        method: str = handler_call_details.method  # type: ignore[attr-defined]

        def guarded_decode(data: bytes) -> Any:
            try:
                return decode(data)
            except DecodeError as err:
                return _Malformed(str(err))

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"request to {method} is not a valid message: {request.reason}",
                )
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=guarded_decode, response_serializer=handler.response_serializer
        )
