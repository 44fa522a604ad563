"""What the servicer is given besides the core: who a call comes from, and who hears of its streams.

broker/server.py builds each (broker/security/callers.py, broker/metrics.py) and passes it in.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from kvbroker.broker.registry import EngineRecord


class StreamObserver(Protocol):
    """Told about each Session-stream message the broker handled (broker/metrics.py)."""

    def message(self, kind: str, code: str, seconds: float) -> None: ...

    def pin(self, outcome: str, seconds: float) -> None: ...


class Callers(Protocol):
    """Who a call comes from, and whether it may act as an engine (broker/security/callers.py's
    SessionCallers; broker/server.py passes it in)."""

    @property
    def session_id_metadata(self) -> str: ...

    @property
    def engine_id_metadata(self) -> str: ...

    def peer_host(self, peer: str) -> str:
        """The host part of a gRPC peer string: a unary call from the engine's host acts as it."""
        ...

    def call_metadata(self, context: grpc.aio.ServicerContext, key: str) -> str: ...

    def check_owner(self, rec: EngineRecord, context: grpc.aio.ServicerContext, what: str) -> None:
        """PermissionDenied unless this call comes from `rec`'s session."""
        ...
