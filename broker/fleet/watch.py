"""Watch across broker replicas: every replica's events in one Redis Stream, so a Watch on any
replica shows the whole fleet.

While anyone in the fleet watches a category (index, lease, engine), every
replica appends its events of that category to the fleet's watch stream,
right after the change that caused them and before the call that made it
answers (so a lease's events are in the order of its transitions: the next
transition comes from that answer, or from another replica's expiry sweep
after it). A replica with Watch streams reads the stream (the mirror streams'
machinery, state_redis_mirror.MirrorStreams) and hands every entry, its own
included, to its watchers: one order for all, each event once. Like the
mirror streams it keeps the last minute, reads on from its last entry after a
lost connection, and when entries were missed (trimmed away, the store
restarted empty, an append that failed) tells its watchers so with an
`events_missed` event instead of skipping them silently.

Who watches what is a sorted set in the store (`{fleet}:watching`, one member
per replica and category, scored by when it lapses), refreshed every second
by the replicas that have watchers and read by all; a replica that starts
watching a category also says so on the fleet channel, so the others start
appending within milliseconds rather than at their next refresh. Events the
other replicas make in that moment before they hear of a new Watch are not in
it. With nobody watching, nothing is appended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvbroker.broker import codec
from kvbroker.broker.channels import StreamNotifier
from kvbroker.broker.errors import BrokerError
from kvbroker.broker.events import EVENTS_MISSED, WatchEvent
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.mirror import MirrorStreams
from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger("kvbroker")

FLEET = "fleet"  # the one "layout" of the watch stream
REFRESH_S = 1.0  # how often a replica renews its watchers' record and reads the fleet's
LAPSE_S = 5.0  # a replica that stopped renewing (it died) counts as not watching after this


class WatchStreams(MirrorStreams):
    """The fleet's watch stream: one stream (and counter) under the `{watch}` hash tag."""

    reader_name = "kvbroker-watch"
    apply_own = True  # a replica's own events reach its watchers through the stream too: one order
    apply_after_gap = True  # after `events_missed`, the event that showed the gap

    def keys(self, layout_id: str) -> list[str]:
        base = f"{self._state.prefix}:{{watch}}:"
        return [base + "s", base + "n"]


class FleetWatch:
    """A replica's part in the fleet's Watch: what it appends, reads, and records of its watchers."""

    def __init__(
        self,
        state: RedisState,
        replica: str,
        local: StreamNotifier,
        announce: Callable[[list[str]], None],
        block_ms: int = 1000,
    ) -> None:
        self._state = state
        self._replica = replica
        self._local = local
        self._announce = announce  # tells the other replicas at once (the fleet channel)
        self._key = f"{state.prefix}:{{fleet}}:watching"
        self.stream = WatchStreams(state, replica, self._apply, self._missed, block_ms)
        self.fleet: frozenset[str] = frozenset()  # categories some replica's watchers want
        self._mine: frozenset[str] = frozenset()  # categories this replica's watchers want

    def wanted(self, category: str) -> bool:
        return category in self._mine or category in self.fleet

    def append(self, event: WatchEvent, now: float, unix_time: float) -> None:
        msg = codec.watch_event_pb(event, now, unix_time)
        self.stream.append(FLEET, event.category, msg.SerializeToString())

    # -- this replica's watchers -------------------------------------------------------

    def watchers_changed(self, categories: frozenset[str]) -> None:
        """The categories this replica's watchers want now (after one came or went)."""
        if categories and not self._mine:
            self.stream.follow(FLEET)  # from the stream's end now, before anyone appends for it
        elif not categories and self._mine:
            self.stream.unfollow(FLEET)
        added = sorted(categories - self._mine)
        self._mine = categories
        try:
            self._record()
        except BrokerError as err:
            log.warning("cannot record this replica's watchers in the store: %s", err)
        if added:
            self._announce(added)

    def heard(self, categories: list[str]) -> None:
        """Another replica has new watchers of these categories: append them from now on."""
        self.fleet = self.fleet | frozenset(categories)

    def _record(self) -> None:
        """Renew this replica's watchers in the store, drop lapsed ones, read the fleet's."""
        now = self._state.now()
        client = self._state.client
        pipe = client.pipeline(transaction=True)
        for category in ("index", "lease", "engine"):
            member = f"{category}|{self._replica}"
            if category in self._mine:
                pipe.zadd(self._key, {member: now + LAPSE_S})
            else:
                pipe.zrem(self._key, member)
        pipe.zremrangebyscore(self._key, "-inf", now)
        pipe.zrange(self._key, 0, -1)
        members = self._state.call(pipe.execute)[-1]
        self.fleet = frozenset(m.decode().partition("|")[0] for m in members)

    async def run(self) -> None:
        """Renew and read the watchers' record every REFRESH_S until cancelled."""
        while True:
            try:
                self._record()
            except BrokerError as err:
                log.debug("watchers' record not refreshed: %s", err)
            await asyncio.sleep(REFRESH_S)

    async def stop(self) -> None:
        await self.stream.stop()

    # -- from the stream to this replica's watchers ------------------------------------------

    def _apply(self, layout_id: str, category: str, body: bytes) -> None:
        self._local.offer(category, pb.WatchEvent.FromString(body))

    def _missed(self, layout_id: str) -> None:
        log.warning("watch events of the fleet were missed: telling this replica's watchers")
        self._local.offer(
            None,
            pb.WatchEvent(
                kind=EVENTS_MISSED,
                detail="events of the broker fleet were missed (the shared store was away or lost "
                "them); list engines and leases for the current state",
                time_unix=self._state.now(),
            ),
        )
