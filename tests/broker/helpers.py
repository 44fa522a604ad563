"""Shared builders for the broker tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbroker.broker.clock import FakeClock
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.core import BrokerCore
from kvbroker.broker.events import WatchEvent
from kvbroker.broker.leases import Lease
from kvbroker.v1 import broker_pb2 as pb


def fingerprint(**overrides: object) -> pb.LayoutFingerprint:
    fields: dict[str, object] = dict(
        model="tiny-llama",
        dtype="float32",
        block_size=32,
        num_layers=2,
        num_kv_heads=2,
        head_size=16,
        tp_size=1,
        pp_size=1,
        hash_algo="sha256",
    )
    fields.update(overrides)
    return pb.LayoutFingerprint(**fields)  # type: ignore[arg-type]


def engine_info(engine_id: str, *, ranks: bool = True, **layout: object) -> pb.EngineInfo:
    fp = fingerprint(**layout)
    info = pb.EngineInfo(engine_id=engine_id, layout=fp, labels={"role": "test"})
    if ranks:
        for tp in range(fp.tp_size or 1):
            info.ranks.append(
                pb.RankInfo(
                    pp_rank=0,
                    tp_rank=tp,
                    agent_name=f"{engine_id}-tp{tp}",
                    agent_metadata=b"meta",
                    start_layer=0,
                    end_layer=fp.num_layers,
                    tiers=[pb.TierInfo(tier=pb.TIER_GPU, mem_type="DRAM", num_blocks=1024)],
                )
            )
    return info


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
