"""Watch across broker replicas: every replica's events go into the fleet's watch stream while anyone
watches, and a replica hands them all (its own included, so one order) to its watchers, each once. A
replica whose connection to Redis was cut reads on from its last entry; entries trimmed away
meanwhile make it tell its watchers `events_missed`. With nobody watching, nothing is appended. On a
standalone Redis and on a Cluster; the same replicas as real processes: tests/process/test_replicas_fleet_view.py.
"""

from __future__ import annotations

import asyncio

import pytest

from kvbroker.broker import events as ev
from kvbroker.broker.channels import Close, Watcher
from kvbroker.broker.events import EVENTS_MISSED as MISSED
from kvbroker.broker.events import WatchEvent
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.leases import RedisLeaseTable
from kvbroker.broker.fleet.notify import FleetNotifier
from kvbroker.broker.fleet.registry import SeenRecords
from kvbroker.broker.security.config import SecurityConfig
from kvbroker.broker.security.engine_identity import EngineIdentity
from kvbroker.broker.security.identity import Identity, Role
from kvbroker.broker.security.quotas import Quotas
from kvbroker.broker.security.tenancy import TenantGuard
from kvbroker.v1 import broker_pb2 as pb
from testkit.clock import FakeClock
from testkit.redis_cluster import RedisCluster
from testkit.redis_server import RedisServer
from testkit.waiting import until
from tests.broker.fleet.test_mirror import cut_connections, node_clients
from tests.broker.helpers import make_core, redis_state


@pytest.fixture(params=["redis", "redis-cluster"])
def store(request: pytest.FixtureRequest) -> RedisServer | RedisCluster:
    found: RedisServer | RedisCluster = request.getfixturevalue(
        "redis_server" if request.param == "redis" else "redis_cluster"
    )
    return found


def replica(state: RedisState, name: str) -> FleetNotifier:
    return FleetNotifier(FakeClock(), state, name, SeenRecords(), RedisLeaseTable(state, history=4))


def engine_event(kind: str, engine_id: str) -> WatchEvent:
    return WatchEvent(ev.ENGINE, kind, engine_id=engine_id)


def subscribers(store: RedisServer | RedisCluster, channel: str) -> int:
    return sum(int(client.pubsub_numsub(channel)[0][1]) for client in node_clients(store))


def queued(watcher: Watcher) -> list[tuple[str, str]]:
    out = []
    while not watcher.queue.empty():
        item = watcher.queue.get_nowait()
        watcher.taken(item)
        assert not isinstance(item, Close), item
        out.append((item.kind, item.engine_id))
    return out


async def test_a_watch_on_one_replica_sees_every_replicas_events_once_in_one_order(
    store: RedisServer | RedisCluster,
) -> None:
    state = redis_state(store)
    a, b = replica(state, "a"), replica(state, "b")
    stream_key = b.watch.stream.keys("")[0]
    # Nobody watches: nothing goes into the stream.
    a.event(engine_event("engine_registered", "X"))
    assert not a.watching(ev.ENGINE)
    assert state.call(state.client.xlen, stream_key) == 0

    watcher = b.add_watcher(frozenset({ev.ENGINE, ev.LEASE}))
    try:
        assert b.watching(ev.ENGINE) and not b.watching(ev.INDEX)
        a.watch._record()  # what a's refresh (or b's notice on the fleet channel) tells it
        assert a.watching(ev.ENGINE) and a.watching(ev.LEASE) and not a.watching(ev.INDEX)

        a.event(engine_event("engine_registered", "P"))
        b.event(engine_event("engine_registered", "D"))  # b's own: through the stream as well
        a.event(engine_event("engine_draining", "P"))
        a.event(WatchEvent(ev.INDEX, "blocks_stored", engine_id="P"))  # nobody watches index events
        await until(lambda: watcher.queue.qsize() >= 3, message="b's watcher missed events")
        await asyncio.sleep(0.1)
        assert queued(watcher) == [
            ("engine_registered", "P"),
            ("engine_registered", "D"),
            ("engine_draining", "P"),
        ]

        # b's connection to Redis is cut; a's events made before it is back still reach it.
        await until(lambda: cut_connections(store, "kvbroker-watch-b") == 1)
        a.event(engine_event("engine_gone", "P"))
        a.event(engine_event("engine_registered", "Q"))
        await until(lambda: watcher.queue.qsize() >= 2, message="b did not read on from its last entry")
        assert b.watch.stream.readers["fleet"].reconnects >= 1  # it really was cut off
        assert queued(watcher) == [("engine_gone", "P"), ("engine_registered", "Q")]

        # Cut off while what it missed was trimmed away: its watchers hear that events were missed.
        await until(lambda: cut_connections(store, "kvbroker-watch-b") == 1)
        a.event(engine_event("engine_gone", "Q"))
        state.call(state.client.xtrim, stream_key, maxlen=0)
        a.event(engine_event("engine_registered", "R"))
        await until(lambda: watcher.queue.qsize() >= 2, message="b missed trimmed events silently")
        assert queued(watcher) == [(MISSED, ""), ("engine_registered", "R")]
    finally:
        b.remove_watcher(watcher)
        await b.watch.stop()

    # b's last watcher left: it stops reading, takes its record out, and the others stop appending.
    assert b.watch.stream.readers == {}
    a.watch._record()
    assert not a.watching(ev.ENGINE)
    before = state.call(state.client.xlen, stream_key)
    a.event(engine_event("engine_registered", "S"))
    assert state.call(state.client.xlen, stream_key) == before


async def test_a_new_watch_is_heard_on_the_fleet_channel(store: RedisServer | RedisCluster) -> None:
    """The notice a replica publishes when it starts watching a category, as another replica reads it."""
    state = redis_state(store)
    a, b = replica(state, "a"), replica(state, "b")
    following = asyncio.create_task(a.follow())
    try:
        channel = f"{state.prefix}:{{fleet}}:notify"
        await until(lambda: subscribers(store, channel) == 1, message="a did not subscribe")
        watcher = b.add_watcher(frozenset({ev.LEASE}))
        await until(lambda: a.watching(ev.LEASE), message="a never heard of b's new watcher")
        assert not a.watching(ev.INDEX)
        b.remove_watcher(watcher)
    finally:
        following.cancel()
        await asyncio.gather(following, b.watch.stop(), return_exceptions=True)


def test_every_watcher_hears_of_missed_events_whatever_its_tenant() -> None:
    """`events_missed` names no engine and no lease: a tenant's operator gets it too (its stream has a
    hole as well), while another tenant's engine event stays hidden."""
    core, _clock, _notifier = make_core()
    guard = TenantGuard(core, Quotas(SecurityConfig()), EngineIdentity(core.registry))
    globex = Identity("globex", Role.OPERATOR, "ops")
    missed = pb.WatchEvent(kind=MISSED, detail="events of the broker fleet were missed")
    assert guard.stream_item(globex, missed) is missed
    beat = pb.WatchEvent(kind=ev.HEARTBEAT, cursor="1-0/1")  # its Watch must not fall silent either
    assert guard.stream_item(globex, beat) is beat
    assert guard.stream_item(globex, pb.WatchEvent(kind="engine_registered", engine_id="p0")) is None


async def test_a_watch_resumes_on_another_replica_after_its_last_cursor(
    store: RedisServer | RedisCluster,
) -> None:
    """Events carry their cursor; another replica gives back those after a cursor (of the categories
    asked for), says when some are no longer kept, and knows where its own reading stands."""
    state = redis_state(store)
    a, b = replica(state, "a"), replica(state, "b")
    watcher = a.add_watcher(frozenset({ev.ENGINE}))
    try:
        b.watch._record()
        for name in ("P", "Q", "R"):
            b.event(engine_event("engine_registered", name))
            b.event(WatchEvent(ev.LEASE, "lease_held", engine_id=name))  # a watches no lease events
        await until(lambda: watcher.queue.qsize() >= 3, message="a's watcher missed events")
        got = [watcher.queue.get_nowait() for _ in range(3)]
        assert all(isinstance(m, pb.WatchEvent) and m.cursor for m in got)
        first = got[0]
        assert isinstance(first, pb.WatchEvent) and first.engine_id == "P"

        again, whole = b.watch_since(first.cursor, frozenset({ev.ENGINE}))
        assert whole and [(m.kind, m.engine_id) for m in again] == [
            ("engine_registered", "Q"),
            ("engine_registered", "R"),
        ]
        assert [m.cursor for m in again] == [m.cursor for m in got[1:]]  # type: ignore[union-attr]
        last = got[-1]
        assert isinstance(last, pb.WatchEvent)
        assert b.watch_since(last.cursor, frozenset({ev.ENGINE})) == ([], True)
        # a's reading stands at its last entry (lease events, which nobody watches, were not appended).
        assert a.watch_position() == last.cursor

        # Trimmed away: the resume says it cannot give them all.
        state.call(state.client.xtrim, b.watch.stream.keys("")[0], maxlen=0)
        b.event(engine_event("engine_gone", "P"))
        again, whole = b.watch_since(first.cursor, frozenset({ev.ENGINE}))
        assert not whole and [(m.kind, m.engine_id) for m in again] == [("engine_gone", "P")]
        again, whole = b.watch_since(last.cursor, frozenset({ev.ENGINE}))  # the one after it is kept
        assert whole and [(m.kind, m.engine_id) for m in again] == [("engine_gone", "P")]
    finally:
        a.remove_watcher(watcher)
        await a.watch.stop()
