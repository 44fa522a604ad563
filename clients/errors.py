"""Typed errors for broker clients, mapped from gRPC status in one table.

Every failed call raises a subclass of ``BrokerError`` carrying the gRPC
``code`` and the broker's ``message`` (written for a person: it names the
field and the limit). ``cause`` is the broker's reason as data, a value of
``kvbroker.common.causes.Cause`` (e.g. ``FailedPrecondition.cause`` says why a
lease ended: ``"ttl_expired"``, ``"released"``, ...), read from the
``google.rpc.ErrorInfo`` the broker sends in ``grpc-status-details-bin`` or
from ``SessionError.cause`` on the session stream; ``""`` when the error has
none (e.g. one gRPC itself raised). ``metadata`` holds the ids it is about
(``lease_id``, ``engine_id``, ...). ``retryable`` tells a caller whether
trying again later can help.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from kvbroker.common.causes import LEASE_ENDED, Cause
from kvbroker.common.error_details import error_info
from kvbroker.v1 import broker_pb2 as pb

# The causes that end a lease by revoking it (RevokeCause labels); LEASE_ENDED adds "released".
REVOKE_CAUSES: tuple[str, ...] = tuple(str(c) for c in LEASE_ENDED if c is not Cause.RELEASED)


class BrokerError(Exception):
    """Base of every error a broker client raises."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    retryable = False

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        cause: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.cause = str(cause)
        self.metadata: dict[str, str] = dict(metadata or {})

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class NotFound(BrokerError):
    """Unknown engine, lease or layout."""

    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(BrokerError):
    """Malformed request: missing field, bad hash list, empty namespace."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class OutOfRange(BrokerError):
    """A number outside its allowed range (TTL, list length); the message states the limit."""

    code = grpc.StatusCode.OUT_OF_RANGE


class FailedPrecondition(BrokerError):
    """Well formed, but the state forbids it: e.g. releasing a revoked lease, or an incompatible layout."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(BrokerError):
    """The engine is not a party to the lease it acts on."""

    code = grpc.StatusCode.PERMISSION_DENIED


class AlreadyExists(BrokerError):
    """Something that must be unique exists already (e.g. a live session for this engine id)."""

    code = grpc.StatusCode.ALREADY_EXISTS
    retryable = True  # the old session ends by itself within its TTL


class ResourceExhausted(BrokerError):
    """A size limit was hit (message too large) or the broker is overloaded."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(BrokerError):
    """The broker cannot be reached, or the session is not connected."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class DeadlineExceeded(BrokerError):
    """No answer within the call's timeout."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    retryable = True


class Cancelled(BrokerError):
    """The call was cancelled (usually by this client closing)."""

    code = grpc.StatusCode.CANCELLED
    retryable = True


class Aborted(BrokerError):
    """A concurrent change won; retrying may succeed."""

    code = grpc.StatusCode.ABORTED
    retryable = True


class Unimplemented(BrokerError):
    """The broker does not implement this call (version mismatch)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Unauthenticated(BrokerError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Internal(BrokerError):
    """A broker bug; the message and the broker's log say more."""

    code = grpc.StatusCode.INTERNAL
    retryable = True


class Unknown(BrokerError):
    code = grpc.StatusCode.UNKNOWN
    retryable = True


ERROR_OF_STATUS: dict[grpc.StatusCode, type[BrokerError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRange,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.DATA_LOSS: Internal,
    grpc.StatusCode.UNKNOWN: Unknown,
}


def from_status(
    code: grpc.StatusCode, message: str, cause: str = "", metadata: Mapping[str, str] | None = None
) -> BrokerError:
    """The typed error for a status code, message and the broker's cause."""
    cls = ERROR_OF_STATUS.get(code, Unknown)
    return cls(message, code, cause, metadata)


def from_code_name(
    code_name: str, message: str, cause: str = "", metadata: Mapping[str, str] | None = None
) -> BrokerError:
    """The typed error for a status code given by name, as in a SessionError."""
    code = getattr(grpc.StatusCode, code_name.upper(), grpc.StatusCode.UNKNOWN)
    return from_status(code, message, cause, metadata)


def from_session_error(error: pb.SessionError) -> BrokerError:
    """The typed error for a SessionError on the session stream (its cause is a field)."""
    return from_code_name(error.code, error.message, error.cause, error.metadata)


def from_rpc_error(err: grpc.RpcError) -> BrokerError:
    """Translate an error raised by a gRPC stub (sync or aio); the cause comes from its ErrorInfo."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    info = error_info(trailing)
    if info is None:
        return from_status(code, details)
    return from_status(code, details, info.cause, info.metadata)
