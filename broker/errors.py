"""The broker's domain errors: a short list of named exceptions.

Each maps to exactly one gRPC status code in broker/status.py. Messages are
meant for a person: they name the offending field and the limit.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base of all domain errors; never raised directly."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(BrokerError):
    """Unknown engine, lease or layout."""


class InvalidArgument(BrokerError):
    """Malformed input: missing field, bad enum, mismatched list lengths."""


class OutOfRange(BrokerError):
    """A number outside its allowed range (TTLs, list lengths)."""


class FailedPrecondition(BrokerError):
    """The request is well formed but the state does not allow it.

    `cause` is the lowercase revoke cause when the lease already ended
    (e.g. "ttl_expired"), else "".
    """

    def __init__(self, message: str, cause: str = "") -> None:
        super().__init__(message)
        self.cause = cause


class PermissionDenied(BrokerError):
    """The engine is not a party of the lease it tries to act on."""


class AlreadyExists(BrokerError):
    """A duplicate that must stay unique (e.g. a session already registered on this stream)."""
