"""The broker's domain errors: a short list of named exceptions.

Each maps to exactly one gRPC status code in broker/status.py. Messages are
meant for a person: they name the offending field and the limit. Each error
also names its `cause` from the shared vocabulary (kvbroker.common.causes),
which travels to clients as data (an ErrorInfo reason), never inside the
message; `metadata` holds the ids it is about (lease_id, engine_id, state).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from kvbroker.common.causes import Cause

# Caps on what an error echoes back: a request's strings may be long, the status (message and
# details trailer) must stay small enough for any client's metadata limit.
MAX_MESSAGE_CHARS = 1024
MAX_METADATA_CHARS = 256
SHOWN_CHARS = 64


def shown(value: str) -> str:
    """`value` quoted for a message; a long one cut, with its length, so an error stays small."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value)} chars)"


def _capped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 24] + f"... ({len(text)} chars)"


class BrokerError(Exception):
    """Base of all domain errors; never raised directly.

    `cause` may be given as a Cause or its value (a RevokeCause label is one);
    a class without a `default_cause` needs it.
    """

    default_cause: ClassVar[Cause | None] = None

    def __init__(
        self, message: str, cause: Cause | str | None = None, metadata: Mapping[str, str] | None = None
    ) -> None:
        message = _capped(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        chosen = Cause(cause) if cause else self.default_cause
        if chosen is None:
            raise TypeError(f"{type(self).__name__} needs a cause: {message}")
        self.cause: Cause = chosen
        self.metadata: dict[str, str] = {
            k: _capped(v, MAX_METADATA_CHARS) for k, v in (metadata or {}).items()
        }


class NotFound(BrokerError):
    """Unknown engine, lease or layout."""


class InvalidArgument(BrokerError):
    """Malformed input: missing field, bad enum, mismatched list lengths."""

    default_cause = Cause.BAD_REQUEST


class OutOfRange(BrokerError):
    """A number outside its allowed range (TTLs, list lengths)."""

    default_cause = Cause.OUT_OF_RANGE


class FailedPrecondition(BrokerError):
    """The request is well formed but the state does not allow it.

    `cause` says which state: a lease-end cause when the lease already ended
    (e.g. "ttl_expired", "released"), else e.g. "draining", "layout_mismatch".
    """


class PermissionDenied(BrokerError):
    """The engine is not a party of the lease it tries to act on."""

    default_cause = Cause.NOT_PARTY


class ResourceExhausted(BrokerError):
    """A limit of the broker is reached (leases per engine, blocks per lease, buffered bytes)."""

    default_cause = Cause.LIMIT_REACHED


class AlreadyExists(BrokerError):
    """A duplicate that must stay unique (e.g. a session already registered on this stream)."""


class QuotaExceeded(ResourceExhausted):
    """A quota of a tenant or identity is used up; the message names the limit."""

    default_cause = Cause.QUOTA_EXCEEDED


class Unavailable(BrokerError):
    """The shared state store (Redis/Valkey) did not answer; nothing changed, retrying may work."""

    default_cause = Cause.STATE_UNAVAILABLE


class Unauthenticated(BrokerError):
    """The call has no credential the broker accepts."""

    default_cause = Cause.UNAUTHENTICATED
