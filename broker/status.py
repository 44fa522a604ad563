"""The one table that maps domain errors to gRPC status codes."""

from __future__ import annotations

import grpc

from kvbroker.broker import errors

STATUS_OF_ERROR: dict[type[errors.BrokerError], grpc.StatusCode] = {
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
}


def status_of(err: errors.BrokerError) -> grpc.StatusCode:
    return STATUS_OF_ERROR[type(err)]
