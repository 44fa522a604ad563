"""How the core tells the outside world: the Notifier protocol and watch events.

The core is synchronous and knows nothing of streams; the transport supplies a
Notifier that turns these calls into SessionDown messages on per-session
queues and WatchEvents on watcher queues.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvbroker.broker.leases import Lease
from kvbroker.common import watch
from kvbroker.common.model import Tier

INDEX, LEASE, ENGINE = "index", "lease", "engine"
EVENTS_MISSED, HEARTBEAT = watch.EVENTS_MISSED, watch.HEARTBEAT  # kinds clients act on


@dataclass(slots=True, frozen=True)
class WatchEvent:
    category: str  # INDEX | LEASE | ENGINE
    kind: str  # e.g. engine_registered, lease_revoked, blocks_stored
    engine_id: str = ""
    lease: Lease | None = None
    blocks: int = 0
    tier: Tier | None = None
    detail: str = ""


class Notifier(Protocol):
    def lease_revoked(self, session_id: str, lease: Lease) -> None:
        """To a reader: the lease ended without a committed read (lease.cause says why)."""
        ...

    def lease_ended(self, session_id: str, lease: Lease) -> None:
        """To a holder: a lease on your blocks ended (released or revoked); free them."""
        ...

    def pin(self, session_id: str, lease: Lease) -> None:
        """To a holder: pin these blocks for lease.reader and answer with a PinResult."""
        ...

    def drain(self, session_id: str, reason: str) -> None: ...

    def engine_generation(self, engine_id: str, generation: int, layout_id: str) -> None:
        """To every other session of `layout_id`: `engine_id` registered a new session numbered
        `generation`; agents of its ranks loaded under an older one are gone (SessionDown.engine_generation)."""
        ...

    def close_session(self, session_id: str, code: str, message: str) -> None:
        """The broker ended this session (TTL missed, superseded): close its stream."""
        ...

    def pin_settled(self, lease: Lease) -> None:
        """A PENDING lease became ACTIVE or ended; whoever waits on it may answer now."""
        ...

    def watching(self, category: str) -> bool:
        """Cheap check so the core builds events only when someone listens."""
        ...

    def event(self, event: WatchEvent) -> None: ...


class NullNotifier:
    """Tells no one; for tools and tests that only look at the core's state."""

    def lease_revoked(self, session_id: str, lease: Lease) -> None:
        pass

    def lease_ended(self, session_id: str, lease: Lease) -> None:
        pass

    def pin(self, session_id: str, lease: Lease) -> None:
        pass

    def drain(self, session_id: str, reason: str) -> None:
        pass

    def engine_generation(self, engine_id: str, generation: int, layout_id: str) -> None:
        pass

    def close_session(self, session_id: str, code: str, message: str) -> None:
        pass

    def pin_settled(self, lease: Lease) -> None:
        pass

    def watching(self, category: str) -> bool:
        return False

    def event(self, event: WatchEvent) -> None:
        pass
