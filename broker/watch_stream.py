"""One Watch stream's events: resumed after a cursor, with heartbeats while nothing happens.

A Watch client with several replicas must notice a frozen or cut-off replica
by its silence (a paused process's kernel keeps the connection open, so gRPC
notices only when a keepalive ping times out, tens of seconds later). It asks
for a `heartbeat` every `heartbeat_ms` the stream had nothing else to send;
after a few missing it moves to another replica and names the cursor of the
last event or heartbeat it saw (`resume_after`). That replica first hands out
the events after the cursor that the fleet's watch stream still keeps (an
`events_missed` first when it cannot give them all), then live ones, without
repeating any it has just replayed.

A cursor is `<stream entry id>/<entry number>`: the entry id orders events
(and survives a store that restarted empty, whose ids still grow with time),
the number shows a gap. A heartbeat's cursor is where this replica's reading
of the stream stands: every event before it has been handed to this Watch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvbroker.broker.channels import Close, SessionNotifier, Watcher
from kvbroker.broker.errors import InvalidArgument
from kvbroker.broker.events import EVENTS_MISSED, HEARTBEAT
from kvbroker.v1 import broker_pb2 as pb

MIN_HEARTBEAT_MS = 100  # a faster request is raised to this
MAX_HEARTBEAT_MS = 600_000


def cursor(entry_id: bytes | str, n: int) -> str:
    """An entry's place in the fleet's watch stream, as a Watch event carries it."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return f"{raw}/{n}"


def parse_cursor(text: str) -> tuple[tuple[int, int], int]:
    """`((ms, seq) of the entry id, entry number)` of a cursor; InvalidArgument if it is not one."""
    entry, _, n = text.partition("/")
    ms, _, seq = entry.partition("-")
    try:
        return (int(ms), int(seq)), int(n)
    except ValueError:
        raise InvalidArgument(
            f"resume_after {text[:64]!r} is not a Watch cursor (<entry id>/<number>): pass the "
            "cursor of the last event or heartbeat received"
        ) from None


def heartbeat_interval(request: pb.WatchRequest) -> float | None:
    """Seconds between heartbeats the request asked for, or None for none."""
    if not request.heartbeat_ms:
        return None
    return min(max(request.heartbeat_ms, MIN_HEARTBEAT_MS), MAX_HEARTBEAT_MS) / 1000


async def watch_items(
    notifier: SessionNotifier, watcher: Watcher, request: pb.WatchRequest
) -> AsyncIterator[pb.WatchEvent | Close]:
    """What the Watch stream sends, in order, for a watcher already registered (so that live
    events queue up while the missed ones are read back). A Close ends the stream."""
    if request.resume_after:
        parse_cursor(request.resume_after)  # bad input is refused before anything is read
    every = heartbeat_interval(request)
    last_key: tuple[int, int] | None = None  # the last event replayed: live ones up to it are repeats
    last_cursor = ""
    if request.resume_after:
        replayed, whole = notifier.watch_since(request.resume_after, watcher.categories)
        if not whole:
            yield pb.WatchEvent(
                kind=EVENTS_MISSED,
                detail="events after the Watch's resume_after cursor are no longer kept (or this "
                "broker keeps none); list engines and leases for the current state",
            )
        for msg in replayed:
            yield msg
        last_key, last_cursor = parse_cursor(request.resume_after)[0], request.resume_after
        if replayed:
            last_key, last_cursor = parse_cursor(replayed[-1].cursor)[0], replayed[-1].cursor
    if every is not None:  # at once: the client learns the stream is up and where it starts
        yield pb.WatchEvent(kind=HEARTBEAT, cursor=_newest(notifier.watch_position(), last_cursor))
    while True:
        if every is None:
            item = await watcher.queue.get()
        else:
            try:
                async with asyncio.timeout(every):
                    item = await watcher.queue.get()
            except TimeoutError:
                last_cursor = _newest(notifier.watch_position(), last_cursor)
                yield pb.WatchEvent(kind=HEARTBEAT, cursor=last_cursor)
                continue
        watcher.taken(item)
        if isinstance(item, pb.WatchEvent) and item.cursor:
            if last_key is not None:
                if parse_cursor(item.cursor)[0] <= last_key:
                    continue  # replayed already
                last_key = None  # live events come in order from here on
            last_cursor = item.cursor
        yield item


def _newest(position: str, last: str) -> str:
    """The later of two cursors (either may be empty)."""
    if not position or not last:
        return position or last
    return position if parse_cursor(position)[0] >= parse_cursor(last)[0] else last
