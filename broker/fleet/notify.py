"""Telling engines across broker replicas: Redis pub/sub carries what the local streams cannot.

A revocation, a lease end, a pin command, a drain or a session close for a
session whose stream is on another replica is published on the fleet's
channel; the replica that holds that stream delivers it (reading the lease
from the shared table, so it sends the lease as it is now). Pin results are
published to all, so a resolve waiting for a pin on any replica answers, and
so is an engine's new generation, which each replica tells its own sessions.

Index changes for Mirror streams (FleetMirrorHub) go through a Redis Stream
per layout instead (broker/fleet/mirror.py), because a mirror must not miss one.

Pub/sub delivers at most once: a message published while a replica is
reconnecting to Redis is lost to it. What depends on it is bounded anyway:
a lost revocation is caught by the reader's failing release (it recomputes),
a lost pin command by the pin timeout. A lost generation notice is made good
when the channel is back: after each resubscription the replica reads the
engines' records from the store and tells its sessions every generation newer
than the last one it told or noted of that engine (``catch_up_generations``);
until then the reader's next lease on that engine names the new generation,
and the reader drops the old agent before reading.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from base64 import b64encode
from binascii import a2b_base64
from collections.abc import Callable, Iterable
from typing import Any

import redis
from google.protobuf.message import DecodeError

from kvbroker.broker.channels import SessionChannel, StreamNotifier, Watcher, ended_down, revoked_down
from kvbroker.broker.clock import Clock
from kvbroker.broker.errors import BrokerError
from kvbroker.broker.events import WatchEvent
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.leases import RedisLeaseTable
from kvbroker.broker.fleet.registry import SeenRecords
from kvbroker.broker.fleet.watch import FleetWatch
from kvbroker.broker.fleet.wire import pushed
from kvbroker.broker.leases import Lease, packed_block_ids, packed_hashes
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.causes import Cause
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier
from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger("kvbroker")

_TO_ALL = ("settled", "moved", "engine", "watching", "generation")  # notices every replica acts on
# ("ends", a nudge to take an engine's inbox of lease ends, goes to the replica that serves it,
# which passes it to all once if the session is not there: see lease_ended)
# Engines whose last generation told is remembered (a fleet's engine ids over a replica's life);
# one forgotten is told again at the next catch-up, which a reader ignores (not newer than its own).
_MOST_TOLD = 65_536


class FleetNotifier(StreamNotifier):
    def __init__(
        self, clock: Clock, state: RedisState, replica: str, seen: SeenRecords, leases: RedisLeaseTable
    ) -> None:
        """`seen`: where the registry keeps the replica serving each session it read (notices go
        there); `leases`: the shared lease table (a notice names its lease, read from there)."""
        super().__init__(clock)
        self._state = state
        self._channel = f"{state.prefix}:{{fleet}}:notify"  # to every replica
        self._mine = f"{self._channel}:{replica}"  # to this one: notices for its sessions
        self._seen = seen
        self._leases = leases
        # The engine of each session served here, whose hold takes its inbox of lease ends.
        self._session_of: dict[str, str] = {}
        if not state.cluster:  # a Cluster's lease ends are published (see lease_ended)
            leases.inbox_holders = self._session_of
        leases.on_ends = self._taken
        # Per session of another replica: the nudge to take its engine's inbox (see lease_ended).
        self._nudges: dict[str, tuple[str, str]] = {}
        self.replica = replica
        self.watch = FleetWatch(
            state, replica, self, lambda c: self._publish("watching", "", cats=",".join(c))
        )
        self.delivered = 0
        self._told: dict[str, int] = {}  # engine id -> the newest generation this replica's sessions heard
        self._generations_noted = False  # catch_up_generations ran once (the first subscription)
        # The fleet channel's liveness: a ping after this long without a message, and how long
        # its answer may take before the connection counts as lost (then: resubscribe, catch up).
        # Longer than a store that pauses for a few TTLs: its subscription resumes as it was.
        self.ping_idle_s = 5.0
        self.pong_wait_s = 10.0

    def _publish(self, kind: str, session_id: str, to_all: bool = False, **more: Any) -> None:
        body = json.dumps({"k": kind, "s": session_id, "rep": self.replica, **more})
        # A session's notice goes to the replica serving it when that is known, so the others
        # spend nothing on it; else to all, and the one serving it delivers it.
        to = None if to_all or kind in _TO_ALL else self._seen.replica_of(session_id)
        channel = f"{self._channel}:{to}" if to else self._channel
        try:
            self._state.publish(channel, body)
        except BrokerError as err:
            log.warning("cannot tell another replica (%s to session %s...): %s", kind, session_id[:8], err)

    def _local(self, session_id: str) -> bool:
        return session_id in self._channels

    def lease_revoked(self, session_id: str, lease: Lease) -> None:
        if self._local(session_id):
            super().lease_revoked(session_id, lease)
        else:
            self._publish_lease("revoked", session_id, lease)

    def lease_ended(self, session_id: str, lease: Lease) -> None:
        if self._local(session_id):
            super().lease_ended(session_id, lease)
        elif (
            not lease.state.live and not self._state.cluster and (to := self._seen.inbox_replica(session_id))
        ):
            # Into the holder's inbox in the store, for its replica to take with the holder's next
            # hold (no wake-up of its own there); if none comes, a nudge on that replica's channel
            # (see RedisLeaseTable.push_end) has it taken within about 0.1 s.
            nudge = self._nudges.get(session_id)
            if nudge is None or nudge[0] != f"{self._channel}:{to}":
                if len(self._nudges) >= _MOST_TOLD:
                    self._nudges.clear()
                body = json.dumps({"k": "ends", "s": session_id, "rep": self.replica, "e": lease.holder})
                nudge = self._nudges[session_id] = (f"{self._channel}:{to}", body)
            notice = ended_down(lease, self._clock.now()).lease_ended.SerializeToString()
            try:
                self._leases.push_end(lease.holder, notice, nudge)
            except BrokerError as err:
                log.warning("cannot tell another replica (ended to session %s...): %s", session_id[:8], err)
        else:
            self._publish_lease("ended", session_id, lease)

    def _publish_lease(self, kind: str, session_id: str, lease: Lease) -> None:
        if lease.state.live:
            self._publish(kind, session_id, lease=lease.lease_id)
            return
        # It ended: it changes no more, so it travels with the notice (no read there), as the
        # session's message itself, encoded once here; the replica serving the session only
        # decodes it (cheaper than rebuilding a Lease from JSON fields and encoding it there).
        down = (revoked_down if kind == "revoked" else ended_down)(lease, self._clock.now())
        self._publish(
            kind, session_id, lease=lease.lease_id, down=b64encode(down.SerializeToString()).decode()
        )

    def engine_changed(self, engine_id: str) -> None:
        """An engine registered, added a rank or ended here: others drop their copy of its record."""
        self._publish("engine", "", engine=engine_id)

    def engine_generation(self, engine_id: str, generation: int, layout_id: str) -> None:
        """This replica's sessions hear it now; every other replica's from the fleet's channel."""
        self._tell_generation(engine_id, generation, layout_id)
        self._publish("generation", "", engine=engine_id, gen=generation, layout=layout_id)

    def _tell_generation(self, engine_id: str, generation: int, layout_id: str) -> bool:
        """Tell this replica's sessions, unless they heard this generation (or a newer one) already."""
        if generation <= self._told.get(engine_id, 0):
            return False
        self._told.pop(engine_id, None)  # most recently told last: the first ones go past the bound
        self._told[engine_id] = generation
        if len(self._told) > _MOST_TOLD:
            del self._told[next(iter(self._told))]
        super().engine_generation(engine_id, generation, layout_id)
        return True

    def catch_up_generations(self, records: Iterable[EngineRecord]) -> int:
        """After the channel was (re)subscribed: tell this replica's sessions every generation in
        `records` (the store's engines) newer than the one they heard of that engine, which covers
        the notices published while the channel was down. How many were told.

        The first call (the replica's first subscription) only notes the generations: what
        registered before this replica started is no news to a session that registers with it,
        and telling every engine to every session would cost engines x sessions messages."""
        if not self._generations_noted:
            self._generations_noted = True
            for r in records:
                self._told[r.engine_id] = max(r.generation, self._told.get(r.engine_id, 0))
            return 0
        return sum(self._tell_generation(r.engine_id, r.generation, r.layout_id) for r in records)

    def pin(self, session_id: str, lease: Lease) -> None:
        if self._local(session_id):
            super().pin(session_id, lease)
        else:
            self._publish("pin", session_id, lease=lease.lease_id)

    def drain(self, session_id: str, reason: str) -> None:
        if self._local(session_id):
            super().drain(session_id, reason)
        else:
            self._publish("drain", session_id, reason=reason)

    def close_session(self, session_id: str, code: str, message: str, cause: Cause | None = None) -> None:
        if self._local(session_id):
            super().close_session(session_id, code, message, cause)
        else:
            self._publish("close", session_id, code=code, message=message, cause=cause or "")

    def pin_settled(self, lease: Lease) -> None:
        super().pin_settled(lease)
        self._publish("settled", "", lease=lease.lease_id)

    # -- lease ends taken from the store ------------------------------------------

    def attach(
        self, session_id: str, max_bytes: int = 64 * 1024 * 1024, record: EngineRecord | None = None
    ) -> SessionChannel:
        channel = super().attach(session_id, max_bytes, record)
        if record is not None:
            self._session_of[record.engine_id] = session_id
            if not self._state.cluster:  # ends put in its inbox while it moved here
                self._take_inbox(record.engine_id)
        return channel

    def detach(self, session_id: str, channel: SessionChannel | None = None) -> bool:
        record = self._channels[session_id].record if session_id in self._channels else None
        done = super().detach(session_id, channel)
        if done and record is not None and self._session_of.get(record.engine_id) == session_id:
            del self._session_of[record.engine_id]
        return done

    def _take_inbox(self, engine_id: str) -> None:
        """Take the engine's inbox now (a waited store call) and send what it held on its own."""
        try:
            notices = self._leases.take_ends(engine_id)
        except BrokerError:
            return  # its next hold takes them
        if notices:
            self._taken(engine_id, notices)

    def _taken(self, engine_id: str, notices: list[bytes]) -> None:
        """Lease ends taken from the engine's inbox: to its session here, with the answer being
        made (if it reads them so) or on their own."""
        channel = self._channels.get(self._session_of.get(engine_id, ""))
        if channel is None:  # its stream left meanwhile: back for the replica that serves it next
            try:
                for notice in notices:
                    self._leases.push_end(engine_id, notice)
            except BrokerError as err:  # never the hold's failure: its lease is made
                log.warning("lease ends of %s lost: %s", engine_id, err)
            return
        ends = []
        for notice in notices:
            try:
                ends.append(pb.LeaseEnded.FromString(notice))
            except DecodeError:
                continue  # not a notice this version wrote
        self.delivered += len(ends)
        channel.hold_ends(ends)

    # -- Watch: the fleet's events, through its watch stream (fleet/watch.py) --------------

    def watching(self, category: str) -> bool:
        return self.watch.wanted(category)

    def event(self, event: WatchEvent) -> None:
        """Into the fleet's stream; this replica's watchers read it back from there with the rest."""
        if self.watch.wanted(event.category):
            self.watch.append(event, self._clock.now(), time.time())

    def add_watcher(self, categories: frozenset[str], max_bytes: int = 16 * 1024 * 1024) -> Watcher:
        watcher = super().add_watcher(categories, max_bytes)
        self.watch.watchers_changed(self._watched())
        return watcher

    def remove_watcher(self, watcher: Watcher) -> None:
        super().remove_watcher(watcher)
        self.watch.watchers_changed(self._watched())

    def watch_position(self) -> str:
        return self.watch.position()

    def watch_since(self, after: str, categories: frozenset[str]) -> tuple[list[pb.WatchEvent], bool]:
        return self.watch.since(after, categories)

    def _watched(self) -> frozenset[str]:
        return frozenset(c for c, n in self._watching.items() if n > 0)

    def session_resumed(self, session_id: str) -> None:
        """This replica took the session over: the one that had its stream lets it go."""
        self._publish("moved", session_id)

    def session_lost(self, session_id: str) -> None:
        """The shared store lost this replica's session: its engine registers again."""
        self.close_session(
            session_id,
            "UNAVAILABLE",
            "the shared state store lost this session; register again",
            Cause.STATE_UNAVAILABLE,
        )

    # -- receiving -------------------------------------------------------------------

    def deliver(self, msg: dict[str, Any]) -> None:
        kind, sid = msg.get("k"), msg.get("s", "")
        if kind == "moved":
            if msg.get("rep") != self.replica:
                self._seen.moved(sid)
                if self._local(sid):
                    super().close_session(
                        sid,
                        "ABORTED",
                        "the session resumed on another broker replica",
                        Cause.SESSION_SUPERSEDED,
                    )
            return
        if kind == "engine":
            if msg.get("rep") != self.replica:
                self._seen.changed(str(msg.get("engine", "")))
            return
        if kind == "generation":
            if msg.get("rep") != self.replica:
                try:
                    generation = int(msg.get("gen", 0))
                except (TypeError, ValueError):
                    return  # not a notice this version wrote
                self._tell_generation(str(msg.get("engine", "")), generation, str(msg.get("layout", "")))
            return
        if kind == "settled" and msg.get("rep") == self.replica:
            return
        if kind == "watching":
            self.watch.heard(str(msg.get("cats", "")).split(","))
            return
        if kind == "ends":  # the engine's inbox holds lease ends that no hold of it took
            engine = str(msg.get("e", ""))
            if self._session_of.get(engine) != sid:
                if not msg.get("fwd"):  # the session moved since the sender read where it was
                    self._publish("ends", sid, e=engine, fwd=1, to_all=True)
                return
            self._take_inbox(engine)
            return
        if kind != "settled" and not self._local(sid):
            return
        if kind == "drain":
            # Another replica drained an engine whose stream is here: mark this replica's record
            # draining (its next push writes the flag to the store, where every replica reads it).
            record = self._channels[sid].record
            if record is not None:
                record.draining = True
            super().drain(sid, str(msg.get("reason", "")))
            return
        if kind == "close":
            cause = Cause(msg["cause"]) if msg.get("cause") else None
            super().close_session(sid, str(msg.get("code", "")), str(msg.get("message", "")), cause)
            return
        down = msg.get("down")
        if isinstance(down, str) and kind in ("revoked", "ended"):
            try:
                ready = pb.SessionDown.FromString(a2b_base64(down, strict_mode=True))
            except (ValueError, DecodeError):
                return  # not a notice this version wrote
            self.delivered += 1
            self._send(sid, ready)
            return
        ended = msg.get("ended")  # how replicas before the encoded notice sent an ended lease
        if isinstance(ended, dict) and kind in ("revoked", "ended"):
            try:
                lease = _ended_lease(str(msg.get("lease", "")), ended)
            except (KeyError, TypeError, ValueError):
                return  # not a notice this version wrote
        else:
            try:
                lease = self._leases.get(str(msg.get("lease", "")))
            except BrokerError:
                return  # gone from the shared table: nothing left to tell
        self.delivered += 1
        if kind == "revoked":
            super().lease_revoked(sid, lease)
        elif kind == "ended":
            super().lease_ended(sid, lease)
        elif kind == "pin":
            super().pin(sid, lease)
        elif kind == "settled":
            super().pin_settled(lease)

    async def follow(self, subscribed: Callable[[], None] | None = None) -> None:
        """Receive the fleet's messages until cancelled, reconnecting to Redis as needed;
        `subscribed` runs after each subscription (what was published before it is lost to it)."""
        while True:
            try:
                client = await self._state.subscriber()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as err:
                log.warning("fleet channel: %s; trying again", err)
                await asyncio.sleep(0.5)
                continue
            try:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
                # that lands as its inner call finishes, and this loop then never ends.
                try:
                    async with asyncio.timeout(self.pong_wait_s):
                        await pubsub.subscribe(self._channel, self._mine)
                except TimeoutError:
                    raise redis.TimeoutError("the store did not confirm the subscription") from None
                conn = pubsub.connection
                assert conn is not None  # subscribe() made it
                if subscribed is not None:
                    subscribed()
                pinged = False
                while True:
                    # Straight from the connection: redis-py's layers per message (retry, parse,
                    # a dict per message) cost more CPU than delivering it. Subscribe
                    # confirmations and pongs are the only other answers on it. A connection
                    # that went silent (a partition, a frozen host: no reset) is found by a ping
                    # after `ping_idle_s` without a message, unanswered for `pong_wait_s`.
                    try:
                        async with asyncio.timeout(self.pong_wait_s if pinged else self.ping_idle_s):
                            answer = await pushed(conn)  # fleet/wire.py
                    except TimeoutError:
                        if pinged:
                            raise redis.TimeoutError("the store did not answer a ping") from None
                        await conn.send_command("PING")
                        pinged = True
                        continue
                    pinged = False
                    if isinstance(answer, list) and len(answer) == 3 and answer[0] == b"message":
                        self.deliver(json.loads(answer[2]))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as err:
                log.warning("fleet channel lost (%s); resubscribing", err)
                await asyncio.sleep(0.5)
            finally:
                await client.aclose()


def _ended_lease(lease_id: str, f: dict[str, Any]) -> Lease:
    return Lease(
        lease_id=lease_id,
        holder=str(f["h"]),
        reader=str(f["r"]),
        namespace=Namespace(str(f["ns"][0]), str(f["ns"][1])),
        tier=Tier(int(f["t"])),
        block_hashes=packed_hashes(int(h) for h in f["bh"]),
        block_ids=packed_block_ids(int(b) for b in f["bi"]),
        state=LeaseState(int(f["st"])),
        ttl_s=0.0,
        deadline=0.0,
        epoch=int(f["ep"]),
        cause=RevokeCause(int(f["c"])),
        detail=str(f["d"]),
        request_id=str(f["q"]),
    )
