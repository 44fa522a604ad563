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

Each event a replica hands out carries its cursor (`<entry id>/<number>`), and
so does each heartbeat (where this replica's reading of the stream stands). A
Watch that moved to another replica (its own was frozen or cut off) names the
last cursor it saw, and `since` reads the entries after it back from the
stream, so the move loses no event that the stream still keeps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvbroker.broker import codec
from kvbroker.broker.channels import StreamNotifier
from kvbroker.broker.errors import BrokerError
from kvbroker.broker.events import EVENTS_MISSED, WatchEvent
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.mirror import LayoutReader, MirrorStreams
from kvbroker.broker.watch_stream import cursor, parse_cursor
from kvbroker.v1 import broker_pb2 as pb

log = logging.getLogger("kvbroker")

FLEET = "fleet"  # the one "layout" of the watch stream
REFRESH_S = 1.0  # how often a replica renews its watchers' record and reads the fleet's
LAPSE_S = 5.0  # a replica that stopped renewing (it died) counts as not watching after this
REPLAY_PAGE = 1000  # entries read back per XRANGE when a Watch resumes


Event = Callable[[str, bytes, str], None]  # category, serialized pb.WatchEvent, cursor


class WatchStreams(MirrorStreams):
    """The fleet's watch stream: one stream (and counter) under the `{watch}` hash tag."""

    reader_name = "kvbroker-watch"
    apply_own = True  # a replica's own events reach its watchers through the stream too: one order
    apply_after_gap = True  # after `events_missed`, the event that showed the gap

    def __init__(
        self,
        state: RedisState,
        replica: str,
        event: Event,
        missed: Callable[[str], None],
        block_ms: int = 1000,
    ) -> None:
        super().__init__(state, replica, lambda *_: None, missed, block_ms)
        self._event = event

    def keys(self, layout_id: str) -> list[str]:
        base = f"{self._state.prefix}:{{watch}}:"
        return [base + "s", base + "n"]

    def _deliver(self, reader: LayoutReader, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """Every entry to the watchers, with its cursor; a gap is told first (`events_missed`)."""
        n = int(fields[b"n"])
        if n != reader.last_n + 1:
            self._resync(reader.layout_id)
        reader.last_id, reader.last_n = entry_id, n
        self._event(fields[b"t"].decode(), fields[b"b"], cursor(entry_id, n))

    def position(self) -> str:
        """The cursor of the last entry read (all before it handed out), or "" when not known."""
        reader = self.readers.get(FLEET)
        if reader is None or reader.last_n < 0:
            return ""
        return cursor(reader.last_id, reader.last_n)


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
        self.replayed = 0  # events read back for Watch streams that resumed here
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

    def _apply(self, category: str, body: bytes, at: str) -> None:
        msg = pb.WatchEvent.FromString(body)
        msg.cursor = at
        self._local.offer(category, msg)

    def since(self, after: str, categories: frozenset[str]) -> tuple[list[pb.WatchEvent], bool]:
        """The events of `categories` after cursor `after` that the stream still keeps, and whether
        that is all of them (False: some were trimmed away or the store restarted since)."""
        start, n = parse_cursor(after)
        key, counter = self.stream.keys(FLEET)
        client = self._state.client
        out: list[pb.WatchEvent] = []
        expected, whole = n + 1, True
        low = f"({start[0]}-{start[1]}"
        while True:
            page: Any = self._state.call(client.xrange, key, low, "+", count=REPLAY_PAGE)
            for entry_id, fields in page:
                number = int(fields[b"n"])
                whole = whole and number == expected
                expected = number + 1
                if fields[b"t"].decode() in categories:
                    msg = pb.WatchEvent.FromString(fields[b"b"])
                    msg.cursor = cursor(entry_id, number)
                    out.append(msg)
            if len(page) < REPLAY_PAGE:
                break
            low = "(" + page[-1][0].decode()
        if expected == n + 1:  # nothing after it: the counter says whether entries were trimmed
            whole = int(self._state.call(client.get, counter) or 0) == n
        self.replayed += len(out)
        return out, whole

    def position(self) -> str:
        return self.stream.position()

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
