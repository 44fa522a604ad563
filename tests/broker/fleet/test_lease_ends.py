"""A lease's end told across replicas through the holder's inbox in the store (broker/fleet/notify.py):
the holder's replica takes it with the holder's next hold, in the same script, and it rides on that
hold's answer (Register.lease_ends_on_answers) or goes just before it; with no hold to take it, a
nudge on the fleet's channel has it taken and sent on its own. Replicas that do not take inboxes
(older ones) still get the notice published, as before."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from kvbroker.broker.fleet import leases as fleet_leases
from kvbroker.broker.fleet.leases import RedisLeaseTable
from kvbroker.broker.fleet.notify import FleetNotifier
from kvbroker.broker.fleet.registry import SeenRecords
from kvbroker.broker.registry import EngineRecord
from kvbroker.clients.engine_session import EngineSession
from kvbroker.common.model import LeaseState, Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info
from testkit.clock import FakeClock
from testkit.redis_server import RedisServer
from testkit.waiting import until
from tests.broker.fleet.test_notify import ended_lease, notices
from tests.broker.helpers import redis_state
from tests.broker.session_util import RawSession, hold_request, two_replicas

H = list(range(9100, 9116))
NEVER_S = 3600.0  # a nudge that does not come within a test


async def read_answer(session: RawSession, seq: int) -> tuple[list[pb.SessionDown], pb.SessionDown]:
    """The messages before the answer to `seq`, and the answer."""
    before = []
    while (down := await session.read()).seq != seq:
        before.append(down)
    return before, down


async def cycle(
    p: RawSession, stub_b: broker_pb2_grpc.KVBrokerStub, ns: pb.Namespace, rid: str
) -> tuple[str, pb.SessionDown, list[pb.SessionDown]]:
    """P (on replica a) holds for D; D (on replica b) acquires and releases: the lease, P's hold answer
    and what P read before it."""
    request = hold_request(ns, H, rid)
    request.reader_engine_id = "D"
    before, answer = await read_answer(p, await p.send(hold=request))
    lid = answer.lease.lease.lease_id
    acquired = await stub_b.Acquire(pb.AcquireRequest(lease_id=lid, reader_engine_id="D"))
    await stub_b.Release(pb.ReleaseRequest(lease_id=lid, reader_engine_id="D", epoch=acquired.lease.epoch))
    return lid, answer, before


@asynccontextmanager
async def p_and_d(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, on_answers: bool = False
) -> AsyncIterator[tuple[Any, Any, RawSession, broker_pb2_grpc.KVBrokerStub, pb.Registered]]:
    """Two replicas a and b, P registered on a and D on b, and no nudge until the test allows it:
    a, b, P's session, a stub on b, and P's registration."""
    monkeypatch.setattr(fleet_leases, "NUDGE_AFTER_S", NEVER_S)
    async with two_replicas(redis_server.url, f"ends{secrets.token_hex(3)}") as ((a, stub_a), (b, stub_b)):
        p, d = RawSession(stub_a), RawSession(stub_b)
        reg = await p.register(engine_info("P"), 60_000, ends_on_answers=on_answers)
        await d.register(engine_info("D"), 60_000)
        try:
            yield a, b, p, stub_b, reg
        finally:
            await p.close()
            await d.close()


@pytest.mark.parametrize("on_answers", [True, False])
async def test_a_lease_end_goes_with_the_holders_next_hold_and_else_by_a_nudge(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, on_answers: bool
) -> None:
    async with p_and_d(redis_server, monkeypatch, on_answers) as (a, b, p, stub_b, reg):
        ns = pb.Namespace(layout_id=reg.layout_id)
        first, _, _ = await cycle(p, stub_b, ns, "one")
        second, answer, before = await cycle(p, stub_b, ns, "two")
        # The first lease's end waited in P's inbox and the second hold took it.
        if on_answers:
            assert [e.lease.lease_id for e in answer.lease_ends] == [first] and before == []
            assert answer.lease_ends[0].lease.state == pb.LEASE_RELEASED
        else:
            assert not answer.lease_ends
            assert [m.lease_ended.lease.lease_id for m in before] == [first]
        # The second one's end: no hold takes it, so the nudge (due at once now) does, on its own.
        monkeypatch.setattr(fleet_leases, "NUDGE_AFTER_S", 0.0)
        ended = await p.read_kind("lease_ended")
        assert ended.lease_ended.lease.lease_id == second and not ended.lease_ends
        assert a.notifier.delivered == 2  # type: ignore[attr-defined]
        assert b.notifier.delivered == 0  # type: ignore[attr-defined]


async def test_a_nudge_that_reaches_a_replica_the_session_left_is_passed_to_all(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with p_and_d(redis_server, monkeypatch) as (a, b, p, stub_b, reg):
        lid, _, _ = await cycle(p, stub_b, pb.Namespace(layout_id=reg.layout_id), "one")
        # The sender read P's record on b (P moved there since, say): b does not serve P, so it
        # passes the nudge to every replica once, and a, which does, takes P's inbox.
        b.notifier.deliver({"k": "ends", "s": reg.session_id, "rep": "gone", "e": "P"})  # type: ignore[attr-defined]
        ended = await p.read_kind("lease_ended")
        assert ended.lease_ended.lease.lease_id == lid and a.notifier.delivered == 1  # type: ignore[attr-defined]
        # A passed-on nudge is not passed on again (no replica serves the session: dropped).
        b.notifier.deliver({"k": "ends", "s": "nobody", "rep": "gone", "e": "X", "fwd": 1})  # type: ignore[attr-defined]


async def test_the_engine_client_reads_the_ends_that_ride_on_answers(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fleet_leases, "NUDGE_AFTER_S", NEVER_S)
    async with two_replicas(redis_server.url, f"ends{secrets.token_hex(3)}") as ((a, _), (b, _)):
        ended: list[str] = []
        p = EngineSession(
            a.address, engine_info("P"), on_lease_ended=lambda m: ended.append(m.lease.lease_id)
        )
        d = EngineSession(b.address, engine_info("D"))
        await p.start(wait_connected_s=10.0)
        await d.start(wait_connected_s=10.0)
        ns = (p.layout_id, "")
        ids = []
        for _ in range(3):
            held = await p.hold(ns, pb.TIER_GPU, H[:4], [1, 2, 3, 4], 30_000, reader_engine_id="D")
            acquired = await d.acquire(held.lease_id)
            await d.release(held.lease_id, acquired.lease.epoch)
            ids.append(held.lease_id)
        # Each hold's answer brought the end of the lease before it, read before the answer.
        assert ended == ids[:2]
        monkeypatch.setattr(fleet_leases, "NUDGE_AFTER_S", 0.0)
        await until(lambda: ended == ids, 5.0, message=f"the last end did not come: {ended}")
        await p.close()
        await d.close()


async def test_a_replica_that_does_not_take_inboxes_gets_the_notice_published(
    redis_server: RedisServer,
) -> None:
    state = redis_state(redis_server)
    clock = FakeClock()
    seen = SeenRecords()
    a = FleetNotifier(clock, state, "a", seen, RedisLeaseTable(state, history=4))
    b_table = RedisLeaseTable(state, history=4)
    b = FleetNotifier(clock, state, "b", SeenRecords(), b_table)
    record = EngineRecord("P", "s-1", engine_info("P"), "lay", 60.0, 0.0, 1)
    channel = b.attach("s-1", record=record)
    channel.ends_on_answers = True
    sent = notices(a)
    lease = ended_lease(LeaseState.RELEASED)
    # An older replica serves s-1 (its record names no inbox): published, as before.
    seen.remember(record, "b", inbox=False)
    a.lease_ended("s-1", lease)
    assert [(n["k"], n["s"]) for n in sent] == [("ended", "s-1")]
    # A replica that takes inboxes: into P's inbox, nothing published; P's next hold takes it.
    seen.remember(record, "b", inbox=True)
    a.lease_ended("s-1", lease)
    assert len(sent) == 1
    held = b_table.create(
        holder="P", reader="D", namespace=Namespace("lay", ""), tier=Tier.GPU, block_hashes=[1],
        block_ids=[1], state=LeaseState.HELD, ttl_s=30.0, deadline=clock.now() + 30.0, request_id="",
    )  # fmt: skip
    reply = pb.SessionDown(seq=7, lease=pb.LeaseResponse(lease=pb.Lease(lease_id=held.lease_id)))
    channel.put_answer(reply)
    assert channel.queue.get_nowait() is reply
    assert [e.lease.lease_id for e in reply.lease_ends] == [lease.lease_id]
    assert b_table.take_ends("P") == []  # taken once


def test_the_record_says_whether_its_replica_takes_inboxes(redis_server: RedisServer) -> None:
    seen = SeenRecords()
    record = EngineRecord("P", "s-1", engine_info("P"), "lay", 60.0, 0.0, 1)
    assert seen.inbox_replica("s-1") is None  # not read
    seen.remember(record, "r1")
    assert seen.inbox_replica("s-1") is None and seen.replica_of("s-1") == "r1"
    seen.remember(record, "r1", inbox=True)
    assert seen.inbox_replica("s-1") == "r1"
    seen.moved("s-1")
    assert seen.inbox_replica("s-1") is None
