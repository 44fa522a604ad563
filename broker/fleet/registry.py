"""Broker replicas sharing one Redis/Valkey: the fleet's engine registry.

Each engine's session stream is served by one replica, its *owner*, which
keeps the local record (heartbeats move its deadline in memory, as in the
in-memory broker) and pushes the deadline and load to the store a few times
a second. Every replica sees every engine (`find`, `all`) through the store,
so resolve names holders on any replica.

Every replica also sweeps the store's session deadlines: a session whose
owner stopped pushing (the replica died) is claimed by exactly one sweeper (a
script removes it from the deadline set) and ended there, leases and blocks
with it. Before that happens, the engine's client reconnects to another
replica and *resumes* the session (Register.resume_session_id): the new
replica takes ownership in one script, and the session id, leases and index
entries stay as they are.

A replica that finds its local record no longer owned (the engine resumed
elsewhere) forgets it without touching the shared state.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from kvbroker.broker.errors import NotFound, Unavailable, shown
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.registry import EngineRecord, EngineRegistry
from kvbroker.common.causes import Cause
from kvbroker.v1 import broker_pb2 as pb

# ARGV: prefix, engine id, session id, replica, deadline.  -> the record, or {} if it is not that session
_RESUME = """
local p = ARGV[1]
local key = p .. 'e:' .. ARGV[2]
if redis.call('HGET', key, 'sid') ~= ARGV[3] then return {} end
if not redis.call('ZSCORE', p .. 'dl', ARGV[3]) then return {} end
redis.call('HSET', key, 'rep', ARGV[4], 'ends', ARGV[4])
redis.call('ZADD', p .. 'dl', ARGV[5], ARGV[3])
return redis.call('HGETALL', key)
"""

# ARGV: prefix, engine id, session id.  Deletes the record only if it is still that session's.
_REMOVE = """
local p = ARGV[1]
redis.call('ZREM', p .. 'dl', ARGV[3])
if redis.call('GET', p .. 's:' .. ARGV[3]) == ARGV[2] then redis.call('DEL', p .. 's:' .. ARGV[3]) end
if redis.call('HGET', p .. 'e:' .. ARGV[2], 'sid') == ARGV[3] then
  redis.call('DEL', p .. 'e:' .. ARGV[2])
  redis.call('SREM', p .. 'engines', ARGV[2])
end
return 1
"""

# ARGV: prefix, now, limit.  Each expired session is claimed by exactly one caller.  -> {record...}
_CLAIM_EXPIRED = """
local p = ARGV[1]
local out = {}
for _, sid in ipairs(redis.call('ZRANGEBYSCORE', p .. 'dl', '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))) do
  redis.call('ZREM', p .. 'dl', sid)
  local eid = redis.call('GET', p .. 's:' .. sid)
  if eid and redis.call('HGET', p .. 'e:' .. eid, 'sid') == sid then
    table.insert(out, redis.call('HGETALL', p .. 'e:' .. eid))
  end
end
return out
"""

# ARGV: prefix, replica, then per session: engine id, session id, deadline, load, draining (0/1), peer host.
# Never revives a session another replica claimed, nor one that moved to another replica.
# -> the session ids the store no longer has as ours (ended elsewhere, moved, or lost by the store)
_PUSH = """
local p = ARGV[1]
local gone = {}
for i = 3, #ARGV, 6 do
  local key = p .. 'e:' .. ARGV[i]
  local rec = redis.call('HMGET', key, 'sid', 'rep')
  -- only the owner moves a deadline: a replica the session left (frozen, cut off) must not
  -- write back the older deadline it still holds
  if rec[1] == ARGV[i + 1] and rec[2] == ARGV[2] and redis.call('ZSCORE', p .. 'dl', ARGV[i + 1]) then
    redis.call('ZADD', p .. 'dl', ARGV[i + 2], ARGV[i + 1])
    redis.call('HSET', key, 'load', ARGV[i + 3], 'drain', ARGV[i + 4], 'host', ARGV[i + 5])
  else
    table.insert(gone, ARGV[i + 1])
  end
end
return gone
"""

# ARGV: prefix, floor.  -> the next generation: one counter for every replica, never below the floor.
_NEXT_GENERATION = """
local k = ARGV[1] .. 'gen'
local g = redis.call('INCR', k)
local floor = tonumber(ARGV[2])
if g < floor then
  redis.call('SET', k, ARGV[2])
  g = floor
end
return g
"""

PUSH_EVERY_S = 0.25  # how often an owner writes its sessions' deadlines and loads to the store
# Another replica's engine record is reused for as long as its owner takes to push a new load; a
# registration, a new rank or a session's end is announced on the fleet's channel and drops it.
SEEN_FOR_S = PUSH_EVERY_S
# After the store was away, other replicas' sessions are not swept until owners pushed anew.
BACK_GRACE_S = 4 * PUSH_EVERY_S
SEEN_MAX = 4096


class SeenRecords:
    """Other replicas' engine records as this replica last read them, and the replica serving each
    session: the registry fills it, the notifier addresses notices with it, and the fleet's notices
    (an engine changed, a session moved) drop what they make stale."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[EngineRecord, float]] = {}  # engine id -> record, when read
        # session id -> its replica, when read, and whether that replica takes lease-end notices
        # from the holder's inbox (broker/fleet/notify.py; replicas before it do not)
        self._serving: dict[str, tuple[str, float, bool]] = {}

    def get(self, engine_id: str) -> EngineRecord | None:
        """The engine's record as read within SEEN_FOR_S (else None: read it again)."""
        seen = self._seen.get(engine_id)
        if seen is not None and time.monotonic() - seen[1] < SEEN_FOR_S:
            return seen[0]
        return None

    def remember(self, rec: EngineRecord, replica: str, inbox: bool = False) -> None:
        now = time.monotonic()
        if len(self._seen) >= SEEN_MAX:
            self._seen.clear()
            self._serving.clear()
        self._seen[rec.engine_id] = (rec, now)
        self._serving[rec.session_id] = (replica, now, inbox)

    def forget(self, engine_id: str) -> None:
        self._seen.pop(engine_id, None)

    def _fresh(self, session_id: str) -> tuple[str, float, bool] | None:
        serving = self._serving.get(session_id)
        if serving is None or time.monotonic() - serving[1] >= SEEN_FOR_S:
            return None
        return serving

    def replica_of(self, session_id: str) -> str | None:
        """The replica serving another replica's session, as read within SEEN_FOR_S (else None)."""
        serving = self._fresh(session_id)
        return serving[0] or None if serving is not None else None

    def inbox_replica(self, session_id: str) -> str | None:
        """The replica serving another replica's session (as read within SEEN_FOR_S) if it takes
        its engine's lease-end notices from the engine's inbox in the store (else None)."""
        serving = self._fresh(session_id)
        return serving[0] if serving is not None and serving[2] else None

    def changed(self, engine_id: str) -> None:
        """Another replica changed this engine's record: read it again when next needed."""
        seen = self._seen.pop(engine_id, None)
        if seen is not None:
            self._serving.pop(seen[0].session_id, None)

    def moved(self, session_id: str) -> None:
        """A session resumed on another replica: it is not where this one last read it."""
        self._serving.pop(session_id, None)


class FleetNews(Protocol):
    """What the registry tells: the other replicas (through the fleet's channel), and this replica's
    own stream of a session the store lost (broker/fleet/notify.py's FleetNotifier)."""

    def session_resumed(self, session_id: str) -> None: ...

    def engine_changed(self, engine_id: str) -> None: ...

    def session_lost(self, session_id: str) -> None: ...


class FleetRegistry(EngineRegistry):
    def __init__(self, state: RedisState, replica: str, seen: SeenRecords, news: FleetNews) -> None:
        super().__init__()
        self._state = state
        self._r: Any = state.client
        self._p = f"{state.prefix}:{{fleet}}:"
        # Scripts name their keys from the prefix; this key (same hash tag) routes them to its slot.
        self._route = [self._p + "dl"]
        self.replica = replica
        self._resume = state.script(_RESUME)
        self._remove = state.script(_REMOVE)
        self._claim = state.script(_CLAIM_EXPIRED)
        self._push_script = state.script(_PUSH)
        self._next_generation = state.script(_NEXT_GENERATION)
        self._claimed: set[str] = set()  # remote sessions this replica claimed to end
        self._pushed = 0.0
        self._swept = 0.0  # when this replica last looked for other replicas' expired sessions
        self._handed: list[EngineRecord] = []  # what the last expiry pass handed out to end
        self._seen = seen  # other replicas' engines, as read
        self._news = news

    # -- the store's records ------------------------------------------------------

    def _write(self, rec: EngineRecord, pipe: Any) -> None:
        pipe.hset(
            self._p + "e:" + rec.engine_id,
            mapping={
                "sid": rec.session_id,
                "rep": self.replica,
                "ends": self.replica,  # this replica takes its sessions' inboxes (see SeenRecords)
                "info": rec.snapshot().SerializeToString(),
                "exp": rec.expected_ranks,
                "rv": rec.ranks_version,
            },
        )

    def _publish(self, rec: EngineRecord, new: bool) -> None:
        pipe = self._r.pipeline(transaction=True)
        self._write(rec, pipe)
        if new:
            pipe.set(self._p + "s:" + rec.session_id, rec.engine_id)
            pipe.sadd(self._p + "engines", rec.engine_id)
            pipe.zadd(self._p + "dl", {rec.session_id: rec.deadline})
        self._state.call(pipe.execute)

    def _record(self, fields: dict[bytes, bytes], deadline: float = 0.0) -> EngineRecord:
        info = pb.EngineInfo.FromString(fields[b"info"])
        ranks = {(r.pp_rank, r.tp_rank): r for r in info.ranks}
        stored = pb.EngineInfo()
        stored.CopyFrom(info)
        del stored.ranks[:]
        return EngineRecord(
            engine_id=info.engine_id,
            session_id=fields[b"sid"].decode(),
            info=stored,
            layout_id=info.layout_id,
            ttl_s=info.session_ttl_ms / 1000,
            deadline=deadline,
            expected_ranks=int(fields[b"exp"]),
            ranks=ranks,
            load=float(fields.get(b"load", info.load)),
            draining=fields.get(b"drain", b"0") == b"1" or info.draining,
            ranks_version=int(fields[b"rv"]),
            peer_host=fields.get(b"host", b"").decode(),  # a unary call from the engine's host acts as it
            generation=info.generation,
            exactness=int(info.exactness) or 1,
            exactness_reason=info.exactness_reason,
        )

    def _remote(self, engine_id: str) -> EngineRecord | None:
        fields = self._remote_fields(engine_id)
        return self._record(fields) if fields else None

    def _remote_fields(self, engine_id: str) -> dict[bytes, bytes] | None:
        flat = self._state.command("HGETALL", self._p + "e:" + engine_id)
        return self._pairs(flat) if flat else None

    @staticmethod
    def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
        return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}

    # -- EngineRegistry -------------------------------------------------------------

    def __len__(self) -> int:
        n: int = self._state.call(self._r.scard, self._p + "engines")
        return n

    def find(self, engine_id: str) -> EngineRecord | None:
        rec = super().find(engine_id)
        if rec is not None:
            return rec
        rec = self._seen.get(engine_id)
        if rec is not None:
            return rec
        fields = self._remote_fields(engine_id)
        if not fields:
            self._seen.forget(engine_id)
            return None
        rec = self._record(fields)
        replica = fields.get(b"rep", b"")
        self._seen.remember(rec, replica.decode(), bool(replica) and fields.get(b"ends") == replica)
        return rec

    def local(self, engine_id: str) -> EngineRecord | None:
        """The engine's record if its session is on this replica (no store read)."""
        return super().find(engine_id)

    def get(self, engine_id: str) -> EngineRecord:
        rec = self.find(engine_id)
        if rec is None:
            return super().get(engine_id)  # raises NotFound with the usual words
        return rec

    def by_session(self, session_id: str) -> EngineRecord:
        try:
            return super().by_session(session_id)
        except NotFound:
            engine_id = self._state.call(self._r.get, self._p + "s:" + session_id)
            rec = self._remote(engine_id.decode()) if engine_id else None
            if rec is None or rec.session_id != session_id:
                raise NotFound(
                    f"unknown session {shown(session_id)}", Cause.UNKNOWN_ENGINE, {"session_id": session_id}
                ) from None
            return rec

    def all(self) -> list[EngineRecord]:
        local = {rec.engine_id: rec for rec in super().all()}
        ids = [i.decode() for i in self._state.call(self._r.smembers, self._p + "engines")]
        pipe = self._r.pipeline(transaction=False)
        others = [i for i in ids if i not in local]
        for engine_id in others:
            pipe.hgetall(self._p + "e:" + engine_id)
        remote = [self._record(f) for f in self._state.call(pipe.execute) if f]
        return [*local.values(), *remote]

    def find_fingerprint(self, lid: str) -> pb.LayoutFingerprint | None:
        fp = super().find_fingerprint(lid)
        if fp is None:
            fp = next((rec.info.layout for rec in self.all() if rec.layout_id == lid), None)
        return fp

    def add(self, info: pb.EngineInfo, ttl_s: float, expected_ranks: int, now: float) -> EngineRecord:
        rec = super().add(info, ttl_s, expected_ranks, now)
        self._publish(rec, new=True)
        self._news.engine_changed(rec.engine_id)
        return rec

    def next_generation(self) -> int:
        """From the store: a restarted engine id is a new generation whichever replica it reaches."""
        floor = str(self._generation_floor())
        return int(self._state.call(self._next_generation, keys=self._route, args=[self._p, floor]))

    def add_rank(self, engine_id: str, rank: pb.RankInfo) -> EngineRecord:
        if super().find(engine_id) is None:
            raise NotFound(
                f"engine {shown(engine_id)} has its session on another broker replica; register its "
                "ranks through that replica (the one its Session stream is connected to)",
                Cause.UNKNOWN_ENGINE,
                {"engine_id": engine_id},
            )
        rec = super().add_rank(engine_id, rank)
        self._publish(rec, new=False)
        self._news.engine_changed(engine_id)
        return rec

    def set_exactness(self, rec: EngineRecord, exactness: int, reason: str) -> None:
        changed = (rec.exactness, rec.exactness_reason) != (exactness, reason)
        super().set_exactness(rec, exactness, reason)
        if changed and super().find(rec.engine_id) is rec:  # the replica that follows it tells the others
            self._publish(rec, new=False)
            self._news.engine_changed(rec.engine_id)

    def remove(self, rec: EngineRecord) -> None:
        super().remove(rec)
        self._claimed.discard(rec.session_id)
        self._state.call(self._remove, keys=self._route, args=[self._p, rec.engine_id, rec.session_id])
        self._seen.forget(rec.engine_id)
        self._news.engine_changed(rec.engine_id)

    # -- shared state --------------------------------------------------------------------

    def resume(
        self, info: pb.EngineInfo, session_id: str, ttl_s: float, expected_ranks: int, now: float
    ) -> EngineRecord | None:
        argv = [self._p, info.engine_id, session_id, self.replica, repr(now + ttl_s)]
        flat = self._state.call(self._resume, keys=self._route, args=argv)
        if not flat:
            return None
        rec = self._record(self._pairs(flat), now + ttl_s)
        rec.ttl_s = ttl_s
        self._seen.forget(rec.engine_id)
        self._engines[rec.engine_id] = rec
        self._by_session[rec.session_id] = rec
        self._fingerprints.setdefault(rec.layout_id, rec.info.layout)
        self._expiry.schedule(rec.session_id, rec.deadline)
        self._compat.clear()
        self._news.session_resumed(rec.session_id)
        return rec

    def owns(self, rec: EngineRecord) -> bool:
        if rec.session_id in self._claimed:
            return True
        fields = self._state.call(self._r.hmget, self._p + "e:" + rec.engine_id, "sid", "rep")
        return fields[0] == rec.session_id.encode() and fields[1] == self.replica.encode()

    def forget(self, rec: EngineRecord) -> None:
        super().remove(rec)

    def expired(self, now: float, limit: int) -> list[EngineRecord]:
        self._push(now)  # with the store away: Unavailable, and no session of ours ends meanwhile
        # Handed out last time and still here: ending it failed (the store went away mid-pass).
        out = [
            r
            for r in self._handed
            if self._by_session.get(r.session_id) is r or r.session_id in self._claimed
        ]
        self._handed = out
        due = super().expired(now, limit)
        for i, rec in enumerate(due):
            try:
                mine = self.owns(rec)
            except Unavailable:
                for later in due[i:]:  # not lost from the queue: checked again once the store is back
                    self._expiry.schedule(later.session_id, now)
                raise
            if mine:
                out.append(rec)
            else:
                self.forget(rec)
        wall = time.monotonic()
        if wall - self._swept < PUSH_EVERY_S:
            return self._hand(out)  # the store's deadlines move only as often as owners push them
        if self._state.back_for() < BACK_GRACE_S:
            # The store just came back: every owner's deadlines in it are as old as the outage.
            # Sweep only once the owners have pushed theirs again.
            return self._hand(out)
        self._swept = wall
        local = set(self._by_session)
        # Another replica's deadlines reach the store up to PUSH_EVERY_S late: wait that out twice.
        for flat in self._state.run(self._claim, self._route, [self._p, repr(now - 2 * PUSH_EVERY_S), limit]):
            rec = self._record(self._pairs(flat), now)
            if rec.session_id in local:
                continue  # ours: our own deadline decides (pushed again next time)
            self._claimed.add(rec.session_id)
            out.append(rec)
        return self._hand(out)

    def _hand(self, out: list[EngineRecord]) -> list[EngineRecord]:
        self._handed = out
        return out

    def extend_sessions(self, seconds: float) -> None:
        super().extend_sessions(seconds)
        self._pushed = 0.0

    def _push(self, now: float) -> None:
        """Write our sessions' deadlines and loads to the store (XX: never revive a claimed one)."""
        wall = time.monotonic()
        if wall - self._pushed < PUSH_EVERY_S or not self._by_session:
            return
        self._pushed = wall
        argv: list[Any] = [self._p, self.replica]
        for rec in self._by_session.values():
            argv += [rec.engine_id, rec.session_id, repr(rec.deadline), repr(rec.load), int(rec.draining)]
            argv.append(rec.peer_host)
        for raw in self._state.run(self._push_script, self._route, argv):
            session_id = raw.decode()
            mine = self._by_session.get(session_id)
            # A record of another session (moved, superseded): that replica tells us itself.
            # A local session the store does not have (a store restarted empty): end its stream so the
            # engine registers again and re-announces, rebuilding the shared index.
            if mine is not None and self._state.call(self._r.exists, self._p + "e:" + mine.engine_id) == 0:
                self._news.session_lost(session_id)
