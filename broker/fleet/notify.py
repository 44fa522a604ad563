"""Telling engines across broker replicas: Redis pub/sub carries what the local streams cannot.

A revocation, a lease end, a pin command, a drain or a session close for a
session whose stream is on another replica is published on the fleet's
channel; the replica that holds that stream delivers it (reading the lease
from the shared table, so it sends the lease as it is now). Pin results are
published to all, so a resolve waiting for a pin on any replica answers.

Index changes for Mirror streams (FleetMirrorHub) go through a Redis Stream
per layout instead (state_redis_mirror), because a mirror must not miss one.

Pub/sub delivers at most once: a message published while a replica is
reconnecting to Redis is lost to it. What depends on it is bounded anyway:
a lost revocation is caught by the reader's failing release (it recomputes),
a lost pin command by the pin timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from kvbroker.broker.channels import StreamNotifier, Watcher
from kvbroker.broker.clock import Clock
from kvbroker.broker.errors import BrokerError
from kvbroker.broker.events import WatchEvent
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.mirror import MirrorStreams
from kvbroker.broker.fleet.watch import FleetWatch
from kvbroker.broker.leases import Lease, packed_block_ids, packed_hashes
from kvbroker.broker.mirror import DEFAULT_MAX_PENDING_BYTES, MirrorHub, MirrorSubscriber, mirror_engine_info
from kvbroker.common.causes import Cause
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier
from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger("kvbroker")

_TO_ALL = ("settled", "moved", "engine", "watching")  # notices every replica acts on


class FleetNotifier(StreamNotifier):
    def __init__(self, clock: Clock, state: RedisState, replica: str) -> None:
        super().__init__(clock)
        self._state = state
        self._channel = f"{state.prefix}:{{fleet}}:notify"  # to every replica
        self._mine = f"{self._channel}:{replica}"  # to this one: notices for its sessions
        # The replica serving a session, as this one last read it (None: not known now).
        self.replica_of: Callable[[str], str | None] = lambda session_id: None
        self.on_moved: Callable[[str], None] = lambda session_id: None  # another replica took it
        self.replica = replica
        self.lease_of: Callable[[str], Lease] | None = None  # the shared lease table's get
        self.on_engine_changed: Callable[[str], None] = lambda engine_id: None  # another replica's
        self.mirrors: FleetMirrorHub | None = None
        self.streams = MirrorStreams(state, replica, self._apply_mirror, self._resync_mirrors)
        self.watch = FleetWatch(
            state, replica, self, lambda c: self._publish("watching", "", cats=",".join(c))
        )
        self.delivered = 0
        # Another replica drained an engine whose stream is here: mark this replica's record draining
        # (its next push writes the flag to the store, where every replica reads it).
        self.on_drain: Callable[[str], None] = lambda session_id: None

    def _publish(self, kind: str, session_id: str, **more: Any) -> None:
        body = json.dumps({"k": kind, "s": session_id, "rep": self.replica, **more})
        # A session's notice goes to the replica serving it when that is known, so the others
        # spend nothing on it; else to all, and the one serving it delivers it.
        to = None if kind in _TO_ALL else self.replica_of(session_id)
        channel = f"{self._channel}:{to}" if to else self._channel
        try:
            self._state.command("PUBLISH", channel, body)
        except BrokerError as err:
            log.warning("cannot tell another replica (%s to session %s...): %s", kind, session_id[:8], err)

    def publish_mirror(self, layout_id: str, change: pb.MirrorBlocks | pb.MirrorEngine) -> None:
        kind = "blocks" if isinstance(change, pb.MirrorBlocks) else "engine"
        self.streams.append(layout_id, kind, change.SerializeToString())

    def _apply_mirror(self, layout_id: str, kind: str, body: bytes) -> None:
        if self.mirrors is None:
            return
        if kind == "blocks":
            self.mirrors.apply_blocks(layout_id, pb.MirrorBlocks.FromString(body))
        else:
            self.mirrors.apply_engine(layout_id, pb.MirrorEngine.FromString(body))

    def _resync_mirrors(self, layout_id: str) -> None:
        log.warning("index changes of layout %s were missed: resyncing its mirrors", layout_id[:12])
        if self.mirrors is not None:
            self.mirrors.resync(layout_id)

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
        else:
            self._publish_lease("ended", session_id, lease)

    def _publish_lease(self, kind: str, session_id: str, lease: Lease) -> None:
        if lease.state.live:
            self._publish(kind, session_id, lease=lease.lease_id)
        else:  # it ended: it changes no more, so it travels with the notice (no read there)
            self._publish(kind, session_id, lease=lease.lease_id, ended=_ended_wire(lease))

    def engine_changed(self, engine_id: str) -> None:
        """An engine registered, added a rank or ended here: others drop their copy of its record."""
        self._publish("engine", "", engine=engine_id)

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

    # -- Watch: the fleet's events, through its watch stream (state_redis_watch) -----------

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

    def _watched(self) -> frozenset[str]:
        return frozenset(c for c, n in self._watching.items() if n > 0)

    def session_resumed(self, session_id: str) -> None:
        """This replica took the session over: the one that had its stream lets it go."""
        self._publish("moved", session_id)

    # -- receiving -------------------------------------------------------------------

    def deliver(self, msg: dict[str, Any]) -> None:
        kind, sid = msg.get("k"), msg.get("s", "")
        if kind == "moved":
            if msg.get("rep") != self.replica:
                self.on_moved(sid)
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
                self.on_engine_changed(str(msg.get("engine", "")))
            return
        if kind == "settled" and msg.get("rep") == self.replica:
            return
        if kind == "watching":
            self.watch.heard(str(msg.get("cats", "")).split(","))
            return
        if kind != "settled" and not self._local(sid):
            return
        if kind == "drain":
            self.on_drain(sid)
            super().drain(sid, str(msg.get("reason", "")))
            return
        if kind == "close":
            cause = Cause(msg["cause"]) if msg.get("cause") else None
            super().close_session(sid, str(msg.get("code", "")), str(msg.get("message", "")), cause)
            return
        ended = msg.get("ended")
        if isinstance(ended, dict) and kind in ("revoked", "ended"):
            try:
                lease = _ended_lease(str(msg.get("lease", "")), ended)
            except (KeyError, TypeError, ValueError):
                return  # not a notice this version wrote
        elif self.lease_of is None:
            return
        else:
            try:
                lease = self.lease_of(str(msg.get("lease", "")))
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

    async def follow(self) -> None:
        """Receive the fleet's messages until cancelled, reconnecting to Redis as needed."""
        while True:
            try:
                client = await self._state.subscriber()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as err:
                log.warning("fleet channel: %s; trying again", err)
                await asyncio.sleep(0.5)
                continue
            try:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self._channel, self._mine)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self.deliver(json.loads(message["data"]))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as err:
                log.warning("fleet channel lost (%s); resubscribing", err)
                await asyncio.sleep(0.5)
            finally:
                await client.aclose()


def _ended_wire(lease: Lease) -> dict[str, Any]:
    """An ended lease's fields for a notice (JSON)."""
    ns = lease.namespace
    return {
        "h": lease.holder,
        "r": lease.reader,
        "ns": [ns.layout_id, ns.tenant],
        "t": int(lease.tier),
        "bh": list(lease.block_hashes),
        "bi": list(lease.block_ids),
        "st": int(lease.state),
        "ep": lease.epoch,
        "c": int(lease.cause),
        "d": lease.detail,
        "q": lease.request_id,
    }


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


class FleetMirrorHub(MirrorHub):
    """Mirrors that follow every replica's index changes, not only this one's."""

    def __init__(self, notifier: FleetNotifier) -> None:
        super().__init__()
        self._notifier = notifier

    def watching(self, layout_id: str) -> bool:
        return True  # a mirror on another replica may be watching

    def subscribe(
        self, layout_id: str, wake: Callable[[], None], max_pending: int = DEFAULT_MAX_PENDING_BYTES
    ) -> MirrorSubscriber:
        sub = super().subscribe(layout_id, wake, max_pending)
        self._notifier.streams.follow(layout_id)  # from the stream's end now, before the snapshot
        return sub

    def unsubscribe(self, sub: MirrorSubscriber) -> None:
        super().unsubscribe(sub)
        if sub.layout_id not in self._by_layout:  # its last mirror here: stop reading the layout
            self._notifier.streams.unfollow(sub.layout_id)

    def blocks(
        self,
        engine_id: str,
        namespace: Namespace,
        tier: Tier,
        stored: Sequence[int] = (),
        removed: Sequence[int] = (),
    ) -> None:
        super().blocks(engine_id, namespace, tier, stored, removed)
        change = pb.MirrorBlocks(
            engine_id=engine_id,
            tenant=namespace.tenant,
            tier=pb.Tier.ValueType(tier),
            stored=stored,
            removed=removed,
        )
        self._notifier.publish_mirror(namespace.layout_id, change)

    def clear_tier(self, engine_id: str, layout_id: str, tier: Tier) -> None:
        super().clear_tier(engine_id, layout_id, tier)
        change = pb.MirrorBlocks(engine_id=engine_id, tier=pb.Tier.ValueType(tier), clear_tier=True)
        self._notifier.publish_mirror(layout_id, change)

    def engine(self, layout_id: str, info: pb.EngineInfo | None, engine_id: str = "") -> None:
        super().engine(layout_id, info, engine_id)
        if info is None:
            change = pb.MirrorEngine(engine=pb.EngineInfo(engine_id=engine_id), gone=True)
        else:
            change = pb.MirrorEngine(engine=mirror_engine_info(info))
        self._notifier.publish_mirror(layout_id, change)

    # -- another replica's changes: to the local mirrors only -----------------------

    def resync(self, layout_id: str) -> None:
        """Changes were missed: the layout's local mirrors start over from a fresh snapshot."""
        for sub in self._by_layout.get(layout_id, ()):
            sub.overflowed, sub.segments, sub.pending = True, [], 0
            sub.wake()

    def apply_blocks(self, layout_id: str, change: pb.MirrorBlocks) -> None:
        if change.clear_tier:
            super().clear_tier(change.engine_id, layout_id, Tier(change.tier))
        else:
            ns = Namespace(layout_id, change.tenant)
            super().blocks(change.engine_id, ns, Tier(change.tier), list(change.stored), list(change.removed))

    def apply_engine(self, layout_id: str, change: pb.MirrorEngine) -> None:
        if change.gone:
            super().engine(layout_id, None, change.engine.engine_id)
        else:
            super().engine(layout_id, change.engine)
