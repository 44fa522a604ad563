"""What the servicer is given besides the core: who a call comes from, and who hears of its streams.

broker/server.py builds each (broker/security/engine_identity.py, broker/metrics.py) and passes it in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import grpc

from kvbroker.broker.registry import EngineRecord


class StreamObserver(Protocol):
    """Told about each Session-stream message the broker handled (broker/metrics.py)."""

    def message(self, kind: str, code: str, seconds: float) -> None: ...

    def pin(self, outcome: str, seconds: float) -> None: ...


class CallerLike(Protocol):
    """Who makes a call that acts as an engine (broker/security/engine_identity.py's Caller)."""

    @property
    def session_id(self) -> str: ...


class EngineCheck(Protocol):
    """The one rule "an engine acts only as itself", and what a caller may see of engines
    (broker/security/engine_identity.py's EngineIdentity; broker/server.py passes it in)."""

    def caller_of(self, context: grpc.aio.ServicerContext) -> Any:
        """Who makes this unary call (its identity, session id metadata, host)."""
        ...

    def session_caller(self, rec: EngineRecord) -> Any:
        """The caller behind a Session stream: the session's engine itself."""
        ...

    def call_metadata(self, context: grpc.aio.ServicerContext, key: str) -> str: ...

    def admit(self, caller: Any, engine_id: str, resume_session_id: str = "") -> None:
        """PermissionDenied unless `caller` may register `engine_id` (no takeover of a live engine)."""
        ...

    def registered(self, rec: EngineRecord, caller: Any) -> None: ...

    def acting_as(self, caller: Any, engine_id: str, what: str) -> EngineRecord | None:
        """PermissionDenied (not_yours) unless `caller` is engine `engine_id`; its live record, if any."""
        ...

    def visible_engines(self) -> Callable[[str], bool] | None:
        """Which engine ids the current caller may see (None: all, no identities)."""
        ...

    def owned_tenants(self) -> Callable[[str], bool] | None:
        """Which tenants' leases the current caller may see (None: all, no identities)."""
        ...
