"""Engine registry: one record per engine with a live session; the Registry protocol and its
in-memory implementation (EngineRegistry; the fleet's is broker/fleet/registry.py).

An engine exists for the broker exactly while its session lives; a record
holds what the engine registered (its EngineInfo: layout, ranks, NIXL agent
metadata), the negotiated session TTL and deadline, its load and whether it
is draining. Session deadlines sit in an expiry queue; heartbeats only move
the deadline on the record (the queue reschedules lazily).

Every new session gets a *generation* (EngineInfo.generation): larger than
every generation this registry issued before, for any engine id, so a
restarted engine id is told apart from its old self by readers that cached
its NIXL agent. The counter starts from the wall clock in microseconds, so a
restarted broker keeps issuing larger numbers than the one before it did
(readers keep their caches across a broker restart); a resumed session keeps
its generation. Shared state (broker/fleet/registry.py) draws it from the
store instead, one counter for every replica.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvbroker.broker.errors import InvalidArgument, NotFound, shown
from kvbroker.broker.expiry import ExpiryQueue
from kvbroker.common.causes import Cause
from kvbroker.common.layout import DEFAULT_HASH_ALGO, check_topology, layout_id
from kvbroker.v1 import broker_pb2 as pb

KNOWN_HASH_ALGOS = ("sha256", "sha256_cbor")


@dataclass(slots=True)
class EngineRecord:
    engine_id: str
    session_id: str
    info: pb.EngineInfo  # as registered; ranks kept in `ranks`
    layout_id: str
    ttl_s: float
    deadline: float
    expected_ranks: int
    ranks: dict[tuple[int, int], pb.RankInfo] = field(default_factory=dict)
    load: float = 0.0
    # The load mirrors last heard of, and when (broker clock): a heartbeat's load is
    # republished only when it changed materially, at most every LOAD_REPUBLISH_S.
    mirrored_load: float = 0.0
    mirrored_at: float = float("-inf")
    draining: bool = False
    ranks_version: int = 0
    peer_host: str = ""  # host of the Session stream's connection (see broker/security/engine_identity.py)
    generation: int = 0  # which registration of the engine id this session is (see the module doc)
    exactness: int = 1  # broker/exactness.py's Exactness as recorded (a KV-event feed's gaps); 1 = exact
    exactness_reason: str = ""
    # Why the broker last told mirrors this engine is silent ("": not silent as they know it;
    # broker/silence.py). Reported as degraded while the recorded state is exact.
    silence: str = ""
    stream_lost: bool = False  # its stream ended while the store was away: end it at the next pass

    @property
    def ready(self) -> bool:
        """All expected ranks have registered (a holder is named only when ready)."""
        return len(self.ranks) >= self.expected_ranks

    def snapshot(self) -> pb.EngineInfo:
        """The EngineInfo as the broker knows it now (ranks merged, layout id set)."""
        out = pb.EngineInfo()
        out.CopyFrom(self.info)
        del out.ranks[:]
        out.ranks.extend(self.ranks[k] for k in sorted(self.ranks))
        out.layout_id = self.layout_id
        out.draining = self.draining
        out.load = self.load
        out.session_ttl_ms = int(self.ttl_s * 1000)
        out.generation = self.generation
        out.exactness = self.exactness  # type: ignore[assignment]
        out.exactness_reason = self.exactness_reason
        if self.silence and self.exactness == 1:
            out.exactness, out.exactness_reason = pb.INDEX_DEGRADED, self.silence
        return out


def validate_fingerprint(fp: pb.LayoutFingerprint) -> None:
    if not fp.model:
        raise InvalidArgument("engine.layout.model is empty; set the served model name")
    for name in ("block_size", "num_layers", "num_kv_heads", "head_size"):
        if getattr(fp, name) == 0:
            raise InvalidArgument(f"engine.layout.{name} must be > 0")
    algo = fp.hash_algo or DEFAULT_HASH_ALGO
    if algo not in KNOWN_HASH_ALGOS:
        raise InvalidArgument(
            f"engine.layout.hash_algo {fp.hash_algo!r} is not one of {', '.join(KNOWN_HASH_ALGOS)}"
        )


def validate_rank(fp: pb.LayoutFingerprint, rank: pb.RankInfo) -> None:
    tp, pp = fp.tp_size or 1, fp.pp_size or 1
    where = f"rank (pp_rank={rank.pp_rank}, tp_rank={rank.tp_rank})"
    if rank.tp_rank >= tp:
        raise InvalidArgument(f"{where}: tp_rank must be < tp_size={tp}")
    if rank.pp_rank >= pp:
        raise InvalidArgument(f"{where}: pp_rank must be < pp_size={pp}")
    if not rank.start_layer < rank.end_layer <= fp.num_layers:
        raise InvalidArgument(
            f"{where}: layer range [{rank.start_layer}, {rank.end_layer}) must be non-empty and "
            f"within [0, {fp.num_layers})"
        )
    for tier in rank.tiers:
        if tier.tier not in (pb.TIER_GPU, pb.TIER_CPU):
            raise InvalidArgument(f"{where}: tier {tier.tier} is not TIER_GPU or TIER_CPU")


class Registry(Protocol):
    """The engines with a live session, as the core reads and changes them (one test body runs
    over every implementation: tests/broker/test_registry_contract.py)."""

    def __len__(self) -> int: ...

    def get(self, engine_id: str) -> EngineRecord:
        """The engine's record; NotFound (unknown_engine) if it has no live session."""
        ...

    def find(self, engine_id: str) -> EngineRecord | None: ...

    def by_session(self, session_id: str) -> EngineRecord:
        """The record of a live session; NotFound (unknown_engine) otherwise."""
        ...

    def all(self) -> list[EngineRecord]: ...

    def own_sessions(self) -> list[EngineRecord]:
        """The engines whose session stream is on this broker (all of them, without shared state)."""
        ...

    def find_fingerprint(self, lid: str) -> pb.LayoutFingerprint | None:
        """A fingerprint of a layout some live engine has (None: none has it)."""
        ...

    def add(self, info: pb.EngineInfo, ttl_s: float, expected_ranks: int, now: float) -> EngineRecord:
        """Validate and add an engine with a new session (the caller ends an old one first)."""
        ...

    def add_rank(self, engine_id: str, rank: pb.RankInfo) -> EngineRecord: ...

    def remove(self, rec: EngineRecord) -> None: ...

    def resume(
        self, info: pb.EngineInfo, session_id: str, ttl_s: float, expected_ranks: int, now: float
    ) -> EngineRecord | None:
        """Take over `session_id` of `info.engine_id` from another replica; None: cannot (register anew)."""
        ...

    def owns(self, rec: EngineRecord) -> bool:
        """Whether ending this session here is this broker's call (False: it moved away)."""
        ...

    def forget(self, rec: EngineRecord) -> None:
        """Drop the local record of a session that moved away, leaving its state alone."""
        ...

    def expired(self, now: float, limit: int) -> list[EngineRecord]:
        """Records whose session deadline passed (they stay registered until the caller removes them)."""
        ...

    def extend_sessions(self, seconds: float) -> None:
        """Move every session deadline later (a stall of the broker is not the engines' fault)."""
        ...

    def expire_at(self, rec: EngineRecord, when: float) -> None:
        """Bring the session's deadline forward to `when` (never later than it was)."""
        ...

    def incompatibility(self, reader: EngineRecord, holder: EngineRecord) -> str | None:
        """Why `reader` cannot read `holder`'s blocks (None = it can)."""
        ...

    def next_generation(self) -> int:
        """A registration generation larger than every one issued before (see the module doc)."""
        ...

    def set_exactness(self, rec: EngineRecord, exactness: int, reason: str) -> None:
        """Record how exact this engine's entries are (broker/exactness.py), for every replica."""
        ...


def wall_clock_us() -> int:
    return time.time_ns() // 1000


class EngineRegistry:
    """The in-memory Registry: one broker owns every session."""

    def __init__(self, generation_floor: Callable[[], int] = wall_clock_us) -> None:
        # The smallest next generation (a wall clock in microseconds by default; tests pass a fake).
        self._generation_floor = generation_floor
        self._last_generation = 0
        self._engines: dict[str, EngineRecord] = {}
        self._by_session: dict[str, EngineRecord] = {}
        self._expiry = ExpiryQueue()
        self._fingerprints: dict[str, pb.LayoutFingerprint] = {}  # layout_id -> a fingerprint
        self._compat: dict[tuple[str, str, int], str | None] = {}

    def __len__(self) -> int:
        return len(self._engines)

    def get(self, engine_id: str) -> EngineRecord:
        rec = self._engines.get(engine_id)
        if rec is None:
            raise NotFound(
                f"unknown engine {shown(engine_id)}: it has no live session (register it first)",
                Cause.UNKNOWN_ENGINE,
                {"engine_id": engine_id},
            )
        return rec

    def find(self, engine_id: str) -> EngineRecord | None:
        return self._engines.get(engine_id)

    def by_session(self, session_id: str) -> EngineRecord:
        rec = self._by_session.get(session_id)
        if rec is None:
            raise NotFound(
                f"unknown session {shown(session_id)}", Cause.UNKNOWN_ENGINE, {"session_id": session_id}
            )
        return rec

    def all(self) -> list[EngineRecord]:
        return list(self._engines.values())

    def own_sessions(self) -> list[EngineRecord]:
        return list(self._engines.values())  # a fleet registry keeps only its own sessions here

    def find_fingerprint(self, lid: str) -> pb.LayoutFingerprint | None:
        return self._fingerprints.get(lid)

    @staticmethod
    def validate(info: pb.EngineInfo) -> dict[tuple[int, int], pb.RankInfo]:
        """Check a registration; returns its ranks keyed by (pp_rank, tp_rank)."""
        if not info.engine_id:
            raise InvalidArgument("engine.engine_id is empty")
        validate_fingerprint(info.layout)
        ranks: dict[tuple[int, int], pb.RankInfo] = {}
        for rank in info.ranks:
            validate_rank(info.layout, rank)
            key = (rank.pp_rank, rank.tp_rank)
            if key in ranks:
                raise InvalidArgument(f"rank (pp_rank={key[0]}, tp_rank={key[1]}) is listed twice")
            ranks[key] = rank
        return ranks

    def add(self, info: pb.EngineInfo, ttl_s: float, expected_ranks: int, now: float) -> EngineRecord:
        """Validate and add an engine; the caller ends any old session of the same id first."""
        ranks = self.validate(info)
        lid = layout_id(info.layout)
        stored = pb.EngineInfo()
        stored.CopyFrom(info)
        del stored.ranks[:]
        rec = EngineRecord(
            engine_id=info.engine_id,
            session_id=secrets.token_hex(16),  # a secret: it proves a call is the engine's
            info=stored,
            layout_id=lid,
            ttl_s=ttl_s,
            deadline=now + ttl_s,
            expected_ranks=expected_ranks,
            ranks=ranks,
            load=info.load,
            generation=self.next_generation(),
        )
        self._engines[rec.engine_id] = rec
        self._by_session[rec.session_id] = rec
        self._fingerprints.setdefault(lid, info.layout)
        self._expiry.schedule(rec.session_id, rec.deadline)
        self._compat.clear()
        return rec

    def next_generation(self) -> int:
        """A generation larger than every one issued before (see the module doc)."""
        self._last_generation = max(self._last_generation + 1, self._generation_floor())
        return self._last_generation

    def add_rank(self, engine_id: str, rank: pb.RankInfo) -> EngineRecord:
        rec = self.get(engine_id)
        validate_rank(rec.info.layout, rank)
        rec.ranks[(rank.pp_rank, rank.tp_rank)] = rank
        rec.ranks_version += 1
        self._compat.clear()
        return rec

    def set_exactness(self, rec: EngineRecord, exactness: int, reason: str) -> None:
        """Record how exact this engine's entries are (broker/exactness.py)."""
        rec.exactness, rec.exactness_reason = exactness, reason

    def remove(self, rec: EngineRecord) -> None:
        if self._engines.get(rec.engine_id) is rec:
            del self._engines[rec.engine_id]
        self._by_session.pop(rec.session_id, None)
        self._expiry.remove(rec.session_id)
        self._compat.clear()
        if not any(e.layout_id == rec.layout_id for e in self._engines.values()):
            self._fingerprints.pop(rec.layout_id, None)

    # -- shared state (the in-memory registry: one broker owns every session) ---------

    def resume(
        self, info: pb.EngineInfo, session_id: str, ttl_s: float, expected_ranks: int, now: float
    ) -> EngineRecord | None:
        """Take over `session_id` of `info.engine_id` from another replica; None: cannot (register anew)."""
        return None

    def owns(self, rec: EngineRecord) -> bool:
        """Whether ending this session here is this broker's call (False: it moved away)."""
        return True

    def forget(self, rec: EngineRecord) -> None:
        """Drop the local record of a session that moved away, leaving its state alone."""
        self.remove(rec)

    def expired(self, now: float, limit: int) -> list[EngineRecord]:
        """Records whose session deadline passed (they stay registered until the caller removes them)."""
        out: list[EngineRecord] = []
        for sid in self._expiry.pop_due(now, limit):
            rec = self._by_session.get(sid)
            if rec is None:
                continue
            if rec.deadline > now:
                self._expiry.schedule(sid, rec.deadline)
            else:
                out.append(rec)
        return out

    def expire_at(self, rec: EngineRecord, when: float) -> None:
        rec.deadline = min(rec.deadline, when)
        self._expiry.schedule(rec.session_id, rec.deadline)

    def extend_sessions(self, seconds: float) -> None:
        """Move every session deadline later (the queue catches up lazily, as after a heartbeat)."""
        for rec in self._by_session.values():
            rec.deadline += seconds

    def incompatibility(self, reader: EngineRecord, holder: EngineRecord) -> str | None:
        """Why `reader` cannot read `holder`'s blocks (None = it can); cached per session pair."""
        key = (reader.session_id, holder.session_id, holder.ranks_version)
        if key in self._compat:
            return self._compat[key]
        if reader.layout_id != holder.layout_id:
            reason: str | None = (
                f"layout ids differ: {reader.engine_id!r} has {reader.layout_id}, "
                f"{holder.engine_id!r} has {holder.layout_id}"
            )
        else:
            reason = check_topology(reader.snapshot(), holder.snapshot())
        self._compat[key] = reason
        return reason
