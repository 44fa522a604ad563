"""The broker's errors on the wire: gRPC's standard rich error model, with plain protobuf.

A failed call carries, besides its status code and message, a serialized
``google.rpc.Status`` in the ``grpc-status-details-bin`` trailing metadata. The
status repeats the code and message and holds one ``google.rpc.ErrorInfo``
detail: ``domain`` is ``kvbroker.v1``, ``reason`` a ``kvbroker.common.causes.Cause``
value and ``metadata`` the ids the error is about (``lease_id``, ``engine_id``,
``state``, ...). Any gRPC client can read it (grpcio-status's
``rpc_status.from_call``, Go's ``status.FromError(err).Details()``, ...);
``error_info`` below reads it without grpc.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "kvbroker.v1"
STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    cause: str  # a Cause value (a newer broker may send one this client does not know)
    metadata: dict[str, str] = field(default_factory=dict)


def status_details(code: int, message: str, cause: str, metadata: Mapping[str, str] | None = None) -> bytes:
    """The ``grpc-status-details-bin`` value for an error: ``code`` is the gRPC status number."""
    info = error_details_pb2.ErrorInfo(reason=str(cause), domain=DOMAIN, metadata=dict(metadata or {}))
    status = status_pb2.Status(code=code, message=message)
    status.details.add().Pack(info)
    return status.SerializeToString()


def error_info(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> ErrorInfo | None:
    """The broker's ErrorInfo in a call's trailing metadata, or None when it sent none."""
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except DecodeError:
            return None
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                if info.domain == DOMAIN:
                    return ErrorInfo(info.reason, dict(info.metadata))
    return None
