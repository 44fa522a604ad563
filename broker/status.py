"""The one table that maps domain errors to gRPC status codes, and how an error leaves the broker.

Every error the broker sends carries, besides the code and the message, its
cause as a google.rpc.ErrorInfo in the grpc-status-details-bin trailer
(kvbroker.common.error_details): `abort` for a unary call or a stream that
ends at once, `trailers` for a stream that ends by returning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NoReturn, TypeVar

import grpc

from kvbroker.broker import errors
from kvbroker.common.causes import Cause
from kvbroker.common.error_details import STATUS_DETAILS_KEY, status_details

T = TypeVar("T")

STATUS_OF_ERROR: dict[type[errors.BrokerError], grpc.StatusCode] = {
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_of(err: errors.BrokerError) -> grpc.StatusCode:
    return STATUS_OF_ERROR[type(err)]


def trailers(
    code: grpc.StatusCode, message: str, cause: Cause | str, metadata: Mapping[str, str] | None = None
) -> tuple[tuple[str, bytes]]:
    """Trailing metadata carrying the error's google.rpc.Status (same code and message)."""
    number: int = code.value[0]
    return ((STATUS_DETAILS_KEY, status_details(number, message, cause, metadata)),)


async def abort(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    cause: Cause | str,
    metadata: Mapping[str, str] | None = None,
) -> NoReturn:
    """End the call with `code` and `message`, its cause in the details trailer."""
    await context.abort(code, message, trailing_metadata=trailers(code, message, cause, metadata))
    raise AssertionError("context.abort returned")  # it always raises


async def answer(context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
    """`fn()`, or the call ended with its domain error (a read of the fleet's shared store can be
    UNAVAILABLE)."""
    try:
        return fn()
    except errors.BrokerError as err:
        await abort(context, status_of(err), err.message, err.cause, err.metadata)
