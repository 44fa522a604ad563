"""What the core's queries return (the codec turns them into responses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbroker.broker.leases import Lease
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.scoring import EngineScore, HolderMatch


@dataclass(slots=True)
class ResolveResult:
    matches: list[HolderMatch]
    lease: Lease | None = None
    holder: EngineRecord | None = None
    skipped_reason: str = ""
    pending: bool = False  # lease is PENDING: answer once Notifier.pin_settled fires


@dataclass(slots=True)
class ScoreResult:
    scores: list[EngineScore]
    total_blocks: int
    block_size: int


@dataclass(slots=True)
class Stats:
    engines: int
    sessions: int
    blocks_indexed: int
    namespaces: int
    leases_by_state: dict[str, int]
    revocations_by_cause: dict[str, int] = field(default_factory=dict)
