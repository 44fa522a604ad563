"""Typed errors for broker clients, mapped from gRPC status in one table.

Every failed call raises a subclass of ``BrokerError`` carrying the gRPC
``code`` and the broker's ``message`` (written for a person: it names the
field and the limit). ``FailedPrecondition.cause`` says why a lease ended
(``"ttl_expired"``, ``"reader_gone"``, ...) when the broker reported one.
``retryable`` tells a caller whether trying again later can help.
"""

from __future__ import annotations

import re

import grpc

# The broker's revoke causes, lowercase, as it writes them in messages and metadata.
REVOKE_CAUSES = (
    "ttl_expired",
    "reader_gone",
    "holder_gone",
    "operator",
    "holder_refused",
    "drain",
    "superseded",
)
# Trailing-metadata key the broker may use to carry a lease's end cause.
CAUSE_METADATA_KEY = "kvbroker-cause"

# Until the broker sends the cause in metadata, read it from its message:
# "lease L was revoked (reader_gone): ...", "... was already released", "... release named epoch N".
_CAUSE_PATTERNS = (
    (re.compile(r"\((" + "|".join(REVOKE_CAUSES) + r")\)"), None),
    (re.compile(r"was already released"), "released"),
    (re.compile(r"release named epoch"), "stale_epoch"),
)


def cause_in_message(message: str) -> str:
    """The lease-end cause a broker message names, or ""."""
    for pattern, fixed in _CAUSE_PATTERNS:
        found = pattern.search(message)
        if found:
            return fixed or found.group(1)
    return ""


class BrokerError(Exception):
    """Base of every error a broker client raises."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    retryable = False

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

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

    def __init__(self, message: str, code: grpc.StatusCode | None = None, cause: str = "") -> None:
        super().__init__(message, code)
        self.cause = cause


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


def from_status(code: grpc.StatusCode, message: str, cause: str = "") -> BrokerError:
    """The typed error for a status code and message."""
    cls = ERROR_OF_STATUS.get(code, Unknown)
    if cls is FailedPrecondition:
        return FailedPrecondition(message, code, cause=cause or cause_in_message(message))
    return cls(message, code)


def from_code_name(code_name: str, message: str) -> BrokerError:
    """The typed error for a status code given by name, as in a SessionError message."""
    code = getattr(grpc.StatusCode, code_name.upper(), grpc.StatusCode.UNKNOWN)
    return from_status(code, message)


def from_rpc_error(err: grpc.RpcError) -> BrokerError:
    """Translate an error raised by a gRPC stub (sync or aio)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    cause = ""
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == CAUSE_METADATA_KEY:
            cause = value.decode() if isinstance(value, bytes) else str(value)
    return from_status(code, details, cause)
