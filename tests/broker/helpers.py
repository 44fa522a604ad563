"""The broker core tests' notifier and core builder (engine builders: testkit.builders)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.core import BrokerCore
from kvbroker.broker.events import WatchEvent
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.leases import Lease
from testkit.clock import FakeClock
from testkit.redis_cluster import RedisCluster
from testkit.redis_server import RedisServer


@dataclass
class Sent:
    kind: str
    session_id: str
    lease: Lease | None = None
    detail: str = ""


@dataclass
class RecordingNotifier:
    """Records what the core tells the engines."""

    sent: list[Sent] = field(default_factory=list)
    settled: list[Lease] = field(default_factory=list)
    events: list[WatchEvent] = field(default_factory=list)

    def lease_revoked(self, session_id: str, lease: Lease) -> None:
        self.sent.append(Sent("revoked", session_id, lease))

    def lease_ended(self, session_id: str, lease: Lease) -> None:
        self.sent.append(Sent("ended", session_id, lease))

    def pin(self, session_id: str, lease: Lease) -> None:
        self.sent.append(Sent("pin", session_id, lease))

    def drain(self, session_id: str, reason: str) -> None:
        self.sent.append(Sent("drain", session_id, detail=reason))

    def engine_generation(self, engine_id: str, generation: int, layout_id: str) -> None:
        self.sent.append(Sent("generation", "", detail=f"{engine_id} {generation} {layout_id}"))

    def close_session(self, session_id: str, code: str, message: str) -> None:
        self.sent.append(Sent("close", session_id, detail=code))

    def pin_settled(self, lease: Lease) -> None:
        self.settled.append(lease)

    def watching(self, category: str) -> bool:
        return True

    def event(self, event: WatchEvent) -> None:
        self.events.append(event)

    def to(self, session_id: str, kind: str) -> list[Sent]:
        return [s for s in self.sent if s.session_id == session_id and s.kind == kind]


def make_core(**config: object) -> tuple[BrokerCore, FakeClock, RecordingNotifier]:
    clock = FakeClock()
    notifier = RecordingNotifier()
    cfg = BrokerConfig(**config)  # type: ignore[arg-type]
    return BrokerCore(cfg, clock=clock, notifier=notifier), clock, notifier


def redis_state(server: RedisServer | RedisCluster) -> RedisState:
    """A RedisState on a real redis-server (or Cluster), under a key prefix of its own (tests share it)."""
    return RedisState(server.url, prefix=f"t{secrets.token_hex(4)}")
