"""One Watch stream's items (broker/watch_stream.py): a heartbeat at once and whenever nothing else
came for heartbeat_ms, the events after a resume cursor first and their live repeats skipped, a
hole said with `events_missed`, a bad cursor refused. The fleet's replay itself:
tests/broker/fleet/test_watch.py; a Watch moving off a frozen replica: tests/process/test_watch_failover.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvbroker.broker import events as ev
from kvbroker.broker.channels import Close, StreamNotifier
from kvbroker.broker.errors import InvalidArgument
from kvbroker.broker.watch_stream import heartbeat_interval, watch_items
from kvbroker.v1 import broker_pb2 as pb
from testkit.clock import FakeClock

LEASES = frozenset({ev.LEASE})


class KeptNotifier(StreamNotifier):
    """An in-memory notifier that keeps past events as a fleet's stream does."""

    def __init__(self, kept: list[pb.WatchEvent], position: str) -> None:
        super().__init__(FakeClock())
        self.kept, self.position = kept, position

    def watch_position(self) -> str:
        return self.position

    def watch_since(self, after: str, categories: frozenset[str]) -> tuple[list[pb.WatchEvent], bool]:
        n = int(after.rpartition("/")[2])
        return [m for m in self.kept if int(m.cursor.rpartition("/")[2]) > n], True


def event(kind: str, n: int) -> pb.WatchEvent:
    return pb.WatchEvent(kind=kind, cursor=f"{1000 + n}-0/{n}")


async def take(items: AsyncIterator[pb.WatchEvent | Close], count: int) -> list[pb.WatchEvent]:
    out = []
    for _ in range(count):
        item = await asyncio.wait_for(anext(items), 10.0)
        assert isinstance(item, pb.WatchEvent)
        out.append(item)
    return out


async def test_heartbeats_come_at_once_and_whenever_the_stream_is_idle() -> None:
    notifier = StreamNotifier(FakeClock())
    watcher = notifier.add_watcher(LEASES)
    items = watch_items(notifier, watcher, pb.WatchRequest(lease_events=True, heartbeat_ms=100))
    first = await take(items, 1)
    assert [(m.kind, m.cursor) for m in first] == [(ev.HEARTBEAT, "")]  # one broker: no cursor
    notifier.offer(ev.LEASE, pb.WatchEvent(kind="lease_held"))
    assert [m.kind for m in await take(items, 3)] == ["lease_held", ev.HEARTBEAT, ev.HEARTBEAT]
    await items.aclose()


async def test_without_heartbeat_ms_nothing_but_events() -> None:
    notifier = StreamNotifier(FakeClock())
    watcher = notifier.add_watcher(LEASES)
    items = watch_items(notifier, watcher, pb.WatchRequest(lease_events=True))
    pending = asyncio.ensure_future(anext(items))
    await asyncio.sleep(0.3)
    assert not pending.done()
    notifier.offer(ev.LEASE, pb.WatchEvent(kind="lease_held"))
    assert (await asyncio.wait_for(pending, 10.0)).kind == "lease_held"  # type: ignore[union-attr]
    await items.aclose()
    assert heartbeat_interval(pb.WatchRequest(heartbeat_ms=1)) == 0.1  # raised to the floor


async def test_a_resumed_watch_gets_what_it_missed_first_and_no_live_repeat() -> None:
    kept = [event("lease_held", 5), event("lease_active", 6), event("lease_released", 7)]
    notifier = KeptNotifier(kept, position=kept[-1].cursor)
    watcher = notifier.add_watcher(LEASES)
    # What the live reader hands this watcher as it catches up: two repeats, then a new one.
    for m in [kept[1], kept[2], event("lease_held", 8)]:
        notifier.offer(ev.LEASE, m)
    request = pb.WatchRequest(lease_events=True, heartbeat_ms=5_000, resume_after=kept[0].cursor)
    items = watch_items(notifier, watcher, request)
    got = await take(items, 4)
    assert [(m.kind, m.cursor) for m in got] == [
        ("lease_active", kept[1].cursor),
        ("lease_released", kept[2].cursor),
        (ev.HEARTBEAT, kept[2].cursor),  # where it stands: everything before it was given
        ("lease_held", "1008-0/8"),
    ]
    await items.aclose()


async def test_a_broker_that_keeps_no_events_says_they_were_missed() -> None:
    notifier = StreamNotifier(FakeClock())
    watcher = notifier.add_watcher(LEASES)
    request = pb.WatchRequest(lease_events=True, resume_after="1000-0/4")
    assert [m.kind for m in await take(watch_items(notifier, watcher, request), 1)] == [ev.EVENTS_MISSED]


@pytest.mark.parametrize("cursor", ["nonsense", "12/x", "a-b/3"])
async def test_a_bad_cursor_is_refused_with_what_to_pass(cursor: str) -> None:
    notifier = StreamNotifier(FakeClock())
    watcher = notifier.add_watcher(LEASES)
    with pytest.raises(InvalidArgument, match="cursor of the last event or heartbeat"):
        await anext(watch_items(notifier, watcher, pb.WatchRequest(resume_after=cursor)))
