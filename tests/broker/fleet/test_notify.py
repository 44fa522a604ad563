"""A lease's end told across replicas (broker/fleet/notify.py): the notice carries the session's
message encoded once, the replica serving the session passes it on as is; a notice in the JSON
fields older replicas send is still read, and one that does not decode is dropped. The same
across real replicas and pub/sub: tests/broker/fleet/test_shared_state.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest

from kvbroker.broker.channels import ended_down, revoked_down
from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.leases import RedisLeaseTable
from kvbroker.broker.fleet.notify import FleetNotifier
from kvbroker.broker.fleet.registry import SeenRecords
from kvbroker.broker.leases import Lease, packed_block_ids, packed_hashes
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier
from kvbroker.v1 import broker_pb2 as pb
from testkit.clock import FakeClock
from testkit.redis_server import RedisServer
from testkit.tcp_proxy import TcpProxy
from testkit.waiting import until
from tests.broker.helpers import redis_state


def ended_lease(state: LeaseState, cause: RevokeCause = RevokeCause.NONE) -> Lease:
    lease = Lease(
        "l-1", "P", "D", Namespace("lay", "acme"), Tier.GPU, packed_hashes([7, 8]), packed_block_ids([1, 2]),
        state, 0.0, 0.0,
    )  # fmt: skip
    lease.epoch, lease.cause, lease.detail, lease.request_id = 3, cause, "why", "req-9"
    return lease


def notices(notifier: FleetNotifier) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    notifier._state.publish = lambda channel, body: sent.append(json.loads(body))  # type: ignore[method-assign]
    return sent


@pytest.mark.parametrize("kind", ["ended", "revoked"])
async def test_an_ended_lease_reaches_the_session_on_another_replica_as_encoded(
    redis_server: RedisServer, kind: str
) -> None:
    state = redis_state(redis_server)
    clock = FakeClock()
    a = FleetNotifier(clock, state, "a", SeenRecords(), RedisLeaseTable(state, history=4))
    b = FleetNotifier(clock, state, "b", SeenRecords(), RedisLeaseTable(state, history=4))
    channel = b.attach("s-1")
    sent = notices(a)
    if kind == "ended":
        lease = ended_lease(LeaseState.RELEASED)
        a.lease_ended("s-1", lease)
        expected = ended_down(lease, clock.now())
    else:
        lease = ended_lease(LeaseState.REVOKED, RevokeCause.DECLINED)
        a.lease_revoked("s-1", lease)
        expected = revoked_down(lease, clock.now())
    assert [(n["k"], n["s"], "down" in n, "ended" in n) for n in sent] == [(kind, "s-1", True, False)]
    b.deliver(sent[0])
    assert channel.queue.get_nowait() == expected
    assert b.delivered == 1

    # An older replica's notice (the lease as JSON fields) is still read ...
    old = {
        "k": "ended", "s": "s-1", "rep": "old", "lease": "l-1",
        "ended": {"h": "P", "r": "D", "ns": ["lay", "acme"], "t": 1, "bh": [7, 8], "bi": [1, 2],
                  "st": int(LeaseState.RELEASED), "ep": 3, "c": 0, "d": "why", "q": "req-9"},
    }  # fmt: skip
    b.deliver(old)
    got = channel.queue.get_nowait()
    assert isinstance(got, pb.SessionDown) and got.lease_ended.lease.block_hashes == [7, 8]
    # ... and one that does not decode is dropped, not delivered half.
    b.deliver({"k": "ended", "s": "s-1", "rep": "x", "lease": "l-1", "down": "not base64!"})
    assert channel.queue.empty() and b.delivered == 2


async def test_a_new_generation_reaches_the_sessions_on_every_replica(redis_server: RedisServer) -> None:
    state = redis_state(redis_server)
    clock = FakeClock()
    a = FleetNotifier(clock, state, "a", SeenRecords(), RedisLeaseTable(state, history=4))
    b = FleetNotifier(clock, state, "b", SeenRecords(), RedisLeaseTable(state, history=4))
    here = a.attach("s-here", record=_record("D1", "s-here"))
    there = b.attach("s-there", record=_record("D2", "s-there"))
    sent = notices(a)
    a.engine_generation("P", 7, "lay")
    expected = pb.SessionDown(engine_generation=pb.EngineGeneration(engine_id="P", generation=7))
    assert here.queue.get_nowait() == expected  # this replica's session: at once
    assert [(n["k"], n["engine"], n["gen"]) for n in sent] == [("generation", "P", 7)]
    a.deliver(sent[0])  # its own notice comes back to it: not told twice
    assert here.queue.empty()
    b.deliver(sent[0])
    assert there.queue.get_nowait() == expected
    b.deliver({"k": "generation", "s": "", "rep": "x", "engine": "P", "gen": "not a number"})
    assert there.queue.empty()  # a notice this version did not write is dropped


async def test_generations_missed_on_the_channel_are_caught_up_from_the_records(
    redis_server: RedisServer,
) -> None:
    """Replica b was not subscribed when P registered anew on a (its channel was down): after it
    subscribes again it tells its sessions what the engines' records say, once per generation."""
    state = redis_state(redis_server)
    clock = FakeClock()
    a = FleetNotifier(clock, state, "a", SeenRecords(), RedisLeaseTable(state, history=4))
    b = FleetNotifier(clock, state, "b", SeenRecords(), RedisLeaseTable(state, history=4))
    there = b.attach("s-there", record=_record("D2", "s-there"))
    # b's first subscription notes what the store holds and tells no one: no news to anyone.
    assert (
        b.catch_up_generations([_record("P", "s-p0", generation=5), _record("R", "s-r", generation=2)]) == 0
    )
    assert there.queue.empty()
    sent = notices(a)
    a.engine_generation("P", 7, "lay")  # b never delivers it: lost to b
    records = [_record("P", "s-p", generation=7), _record("Q", "s-q", generation=3), _record("R", "s-r", 2)]
    assert b.catch_up_generations(records) == 2, "P's new generation, and Q, which registered meanwhile"
    told = [there.queue.get_nowait().engine_generation for _ in range(2)]
    assert [(g.engine_id, g.generation) for g in told] == [("P", 7), ("Q", 3)]
    assert there.queue.empty(), "R did not change"
    assert b.catch_up_generations(records) == 0, "told already"
    b.deliver(sent[0])  # the notice itself, late: not told twice
    b.deliver({"k": "generation", "s": "", "rep": "a", "engine": "P", "gen": 6, "layout": "lay"})  # older
    assert there.queue.empty()
    assert b.catch_up_generations([_record("P", "s-p2", generation=9)]) == 1
    assert there.queue.get_nowait().engine_generation.generation == 9


async def test_a_silent_fleet_channel_is_found_by_its_ping_and_subscribed_again(
    redis_server: RedisServer,
) -> None:
    """Replica b reaches Redis through a link that goes dark (no reset, as a partition or a frozen
    host): its subscription hears nothing, its ping gets no answer, it subscribes again once the
    link is back, catches up (`subscribed`) and hears what is published after that."""
    a_state = redis_state(redis_server)
    with TcpProxy(f"127.0.0.1:{redis_server.port}") as link:
        b_state = RedisState(f"redis://{link.address}/0", prefix=a_state.prefix)
        clock = FakeClock()
        a = FleetNotifier(clock, a_state, "a", SeenRecords(), RedisLeaseTable(a_state, history=4))
        b = FleetNotifier(clock, b_state, "b", SeenRecords(), RedisLeaseTable(b_state, history=4))
        b.ping_idle_s, b.pong_wait_s = 0.3, 0.3
        there = b.attach("s-there", record=_record("D2", "s-there"))
        subscriptions: list[float] = []
        following = asyncio.create_task(b.follow(lambda: subscriptions.append(1.0)))
        try:
            await until(lambda: len(subscriptions) == 1, timeout=10.0)
            a.engine_generation("P", 7, "lay")
            await until(lambda: not there.queue.empty(), timeout=10.0)
            assert there.queue.get_nowait().engine_generation.generation == 7
            link.blackhole()
            await asyncio.sleep(2.0)  # pings unanswered, subscriptions that go nowhere
            a.engine_generation("P", 8, "lay")  # lost to b
            assert len(subscriptions) == 1 and there.queue.empty()
            link.restore()
            await until(lambda: len(subscriptions) >= 2, timeout=10.0)

            def heard() -> bool:
                # Published again while unheard: on a loaded machine a pong later than the test's
                # 0.3 s makes b subscribe once more, and what is published in between is lost.
                if there.queue.empty():
                    a.engine_generation("P", 9, "lay")
                    return False
                return True

            await until(heard, timeout=10.0, interval=0.2)
            assert there.queue.get_nowait().engine_generation.generation == 9
            assert there.queue.empty(), "told once, however often it was published"
        finally:
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following


def _record(engine_id: str, session_id: str, generation: int = 0) -> EngineRecord:
    return EngineRecord(
        engine_id, session_id, pb.EngineInfo(engine_id=engine_id), "lay", 5.0, 5.0, 0, generation=generation
    )
