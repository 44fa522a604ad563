"""The SessionNotifier contract: every backend must pass these (in-memory, Redis, and a Redis Cluster).

A fleet's notifier tells a session served on its own replica exactly as the in-memory one does; what
crosses replicas (notices over pub/sub, the fleet's watch stream) is tested with two replicas in
test_shared_state.py and test_fleet_watch_stream.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvbroker.broker import events as ev
from kvbroker.broker.channels import Close, SessionChannel, SessionNotifier, StreamNotifier, Watcher
from kvbroker.broker.fleet.leases import RedisLeaseTable
from kvbroker.broker.fleet.notify import FleetNotifier
from kvbroker.broker.fleet.registry import SeenRecords
from kvbroker.broker.leases import Lease
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.causes import Cause
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier
from kvbroker.v1 import broker_pb2 as pb
from testkit.clock import FakeClock
from testkit.waiting import until
from tests.broker.helpers import redis_state

BACKENDS = ["in-memory", "redis", "redis-cluster"]


@pytest.fixture(params=BACKENDS)
async def notifier(request: pytest.FixtureRequest) -> AsyncIterator[SessionNotifier]:
    if request.param == "in-memory":
        yield StreamNotifier(FakeClock())
        return
    # A real redis-server, or a real 3-primary Redis Cluster, started by the tests.
    state = redis_state(
        request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
    )
    fleet = FleetNotifier(FakeClock(), state, "r1", SeenRecords(), RedisLeaseTable(state, history=4))
    try:
        yield fleet
    finally:
        await fleet.watch.stop()


def lease(lease_id: str = "L1", state: LeaseState = LeaseState.HELD) -> Lease:
    return Lease(
        lease_id=lease_id,
        holder="P",
        reader="D",
        namespace=Namespace("layout", ""),
        tier=Tier.GPU,
        block_hashes=(1, 2),
        block_ids=(10, 11),
        state=state,
        ttl_s=5.0,
        deadline=5.0,
        cause=RevokeCause.TTL_EXPIRED if state is LeaseState.REVOKED else RevokeCause.NONE,
    )


def queued(channel: SessionChannel) -> list[pb.SessionDown | Close]:
    out = []
    while not channel.queue.empty():
        item = channel.queue.get_nowait()
        channel.taken(item)
        out.append(item)
    return out


def watched(watcher: Watcher) -> list[pb.WatchEvent | Close]:
    out = []
    while not watcher.queue.empty():
        item = watcher.queue.get_nowait()
        watcher.taken(item)
        out.append(item)
    return out


async def test_a_session_hears_what_the_core_tells_it_in_order(notifier: SessionNotifier) -> None:
    channel = notifier.attach("s1")
    other = notifier.attach("s2")
    notifier.pin("s1", lease())
    notifier.lease_revoked("s1", lease(state=LeaseState.REVOKED))
    notifier.lease_ended("s1", lease("L2", LeaseState.RELEASED))
    notifier.drain("s1", "maintenance")
    sent = queued(channel)
    assert [m.WhichOneof("msg") for m in sent if isinstance(m, pb.SessionDown)] == [
        "pin",
        "revoked",
        "lease_ended",
        "drain",
    ]
    assert len(sent) == 4 and channel.pending_bytes == 0
    down = sent[1]
    assert isinstance(down, pb.SessionDown) and down.revoked.lease.lease_id == "L1"
    assert down.revoked.cause == int(RevokeCause.TTL_EXPIRED)
    assert queued(other) == []  # another session hears nothing of it


def record(engine_id: str, session_id: str, layout_id: str) -> EngineRecord:
    return EngineRecord(engine_id, session_id, pb.EngineInfo(engine_id=engine_id), layout_id, 5.0, 5.0, 0)


async def test_a_new_generation_reaches_the_other_sessions_of_its_layout_only(
    notifier: SessionNotifier,
) -> None:
    reader = notifier.attach("s-reader", record=record("D", "s-reader", "lay-a"))
    itself = notifier.attach("s-old-P", record=record("P", "s-old-P", "lay-a"))  # its stream not yet closed
    foreign = notifier.attach("s-other", record=record("X", "s-other", "lay-b"))
    notifier.engine_generation("P", 42, "lay-a")
    sent = queued(reader)
    assert [m.engine_generation for m in sent if isinstance(m, pb.SessionDown)] == [
        pb.EngineGeneration(engine_id="P", generation=42)
    ]
    assert queued(itself) == [] and queued(foreign) == []


async def test_a_closed_session_gets_one_close_with_its_cause_then_nothing(notifier: SessionNotifier) -> None:
    channel = notifier.attach("s1")
    notifier.close_session("s1", "DEADLINE_EXCEEDED", "no heartbeat")
    notifier.close_session("s1", "ABORTED", "again")  # already closed: not twice
    notifier.drain("s1", "after the close")
    sent = queued(channel)
    assert sent == [Close("DEADLINE_EXCEEDED", "no heartbeat", Cause.SESSION_EXPIRED)]
    notifier.detach("s1")
    notifier.drain("s1", "detached")  # no stream: nowhere to send, and no error


async def test_a_session_that_does_not_read_is_ended_not_grown(notifier: SessionNotifier) -> None:
    channel = notifier.attach("s1", max_bytes=200)
    for i in range(20):
        notifier.pin("s1", lease(f"L{i}"))
    sent = queued(channel)
    assert isinstance(sent[-1], Close) and sent[-1].code == "RESOURCE_EXHAUSTED"
    assert sent[-1].cause == Cause.LIMIT_REACHED and len(sent) < 20


async def test_a_pin_waiter_is_told_once_when_the_lease_settles(notifier: SessionNotifier) -> None:
    told: list[str] = []
    notifier.wait_pin("L1", lambda settled: told.append(settled.lease_id))
    notifier.wait_pin("L2", lambda settled: told.append(settled.lease_id))
    notifier.pin_settled(lease("L1", LeaseState.ACTIVE))
    notifier.pin_settled(lease("L1", LeaseState.ACTIVE))
    assert told == ["L1"]


async def test_a_watcher_hears_the_categories_it_asked_for(notifier: SessionNotifier) -> None:
    assert not notifier.watching(ev.ENGINE)
    watcher = notifier.add_watcher(frozenset({ev.ENGINE}))
    assert notifier.watcher_count() == 1
    assert notifier.watching(ev.ENGINE) and not notifier.watching(ev.INDEX)
    notifier.event(ev.WatchEvent(ev.INDEX, "blocks_stored", engine_id="P", blocks=2))
    notifier.event(ev.WatchEvent(ev.ENGINE, "engine_registered", engine_id="P"))
    await until(lambda: not watcher.queue.empty(), message="the watcher never heard of the engine")
    # (A fleet's watch stream keeps its order: an index event would have come first.)
    heard = watched(watcher)
    assert [(e.kind, e.engine_id) for e in heard if isinstance(e, pb.WatchEvent)] == [
        ("engine_registered", "P")
    ]
    assert len(heard) == 1
    notifier.remove_watcher(watcher)
    assert notifier.watcher_count() == 0 and not notifier.watching(ev.ENGINE)


async def test_close_all_ends_every_session_and_watcher(notifier: SessionNotifier) -> None:
    channels = [notifier.attach(f"s{i}") for i in range(2)]
    watcher = notifier.add_watcher(frozenset({ev.LEASE}))
    notifier.close_all("UNAVAILABLE", "shutting down", Cause.SHUTTING_DOWN)
    for channel in channels:
        assert queued(channel) == [Close("UNAVAILABLE", "shutting down", Cause.SHUTTING_DOWN)]
    assert watched(watcher) == [Close("UNAVAILABLE", "shutting down", Cause.SHUTTING_DOWN)]
    notifier.remove_watcher(watcher)
