"""`--state redis://...`: what the shared store adds beyond the contract suites (which run the
same API tests on both backends): a bad URL is refused at start, a store that stops answering
turns lease calls into UNAVAILABLE (state_unavailable) without crashing the broker, a store
back empty ends the sessions it lost (engines register again), and the broker works again."""

from __future__ import annotations

import asyncio
import secrets
import time

import grpc
import pytest
import redis
import redis.asyncio

from kvbroker.broker.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvbroker.broker.fleet import registry as state_redis_fleet
from kvbroker.broker.fleet.leases import RedisLeaseTable
from kvbroker.broker.leases import Lease
from kvbroker.common.error_details import STATUS_DETAILS_KEY
from kvbroker.common.model import LeaseState, Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import running_broker
from testkit.builders import engine_info
from testkit.ports import free_port
from testkit.redis_server import RedisServer
from testkit.waiting import wait_for
from tests.broker.helpers import redis_state
from tests.broker.session_util import RawSession, hold_request, p_holding, two_replicas

H = list(range(7000, 7016))


async def test_a_state_url_that_is_not_redis_or_does_not_answer_is_refused_at_start() -> None:
    with pytest.raises(InvalidArgument, match="not a Redis URL"):
        async with running_broker(state="memcached://127.0.0.1:1"):
            pass
    with pytest.raises(InvalidArgument, match="does not answer"):
        async with running_broker(state=f"redis://127.0.0.1:{free_port()}"):
            pass


async def test_store_down_means_unavailable_then_back_to_work(own_redis: RedisServer) -> None:
    store = own_redis  # a store of its own: this test stops it
    async with (
        running_broker(state=store.url, session_ttl_min_ms=100, expiry_interval_ms=20) as broker,
        grpc.aio.insecure_channel(broker.address) as channel,
    ):
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        p, ns, held = await p_holding(stub, engine_info("P"), H)

        store.stop()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Hold(hold_request(ns, H, "during"))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        # The first call finds it gone ("does not answer") unless a probe already marked the store
        # away ("has not answered ...; failing fast"): both name the store and say why.
        assert any(w in (exc.value.details() or "") for w in ("does not answer", "has not answered"))
        details = dict(exc.value.trailing_metadata() or ()).get(STATUS_DETAILS_KEY)
        assert details is not None and b"state_unavailable" in details

        # Same port, empty store (as after a failover that lost writes): the lease
        # Redis lost reads as unknown, never as live; new work goes through.
        store.start()
        # The replica fails fast until its probe (off the loop, every 50 ms) finds the store back.
        for _ in range(100):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Release(pb.ReleaseRequest(lease_id=held.lease.lease_id, reader_engine_id="D"))
            if exc.value.code() != grpc.StatusCode.UNAVAILABLE:
                break
            await asyncio.sleep(0.02)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        assert "recompute" in (exc.value.details() or "")
        # The store lost P's session too: the broker ends its stream so that P registers
        # again and re-announces (which rebuilds the index); then P holds again.
        error = (await p.read_kind("error")).error
        assert (error.code, error.cause) == ("UNAVAILABLE", "state_unavailable")
        p = RawSession(stub)
        await p.register(engine_info("P"), 60_000)
        await p.announce(ns, pb.TIER_GPU, H)
        await p.applied()
        again = await stub.Hold(hold_request(ns, H, "after"))
        assert again.lease.state == pb.LEASE_HELD
        assert redis.Redis.from_url(store.url).exists(f"kvb:{{leases}}:l:{again.lease.lease_id}")
        await p.close()


def test_a_deadline_another_replica_shortened_is_enforced_by_the_transition(
    redis_server: RedisServer,
) -> None:
    state = redis_state(redis_server)
    here, there = RedisLeaseTable(state), RedisLeaseTable(state)
    ns = Namespace("layout", "")
    lease = here.create(
        holder="P",
        reader="D",
        namespace=ns,
        tier=Tier.GPU,
        block_hashes=[1, 2],
        block_ids=[3, 4],
        state=LeaseState.HELD,
        ttl_s=10.0,
        deadline=10.0,
        request_id="",
    )
    there.claim(lease.lease_id, "D", 1.0, now=0.0)  # the reader's TTL: due at 1.0
    assert here.expire_if_due(lease.lease_id, now=2.0) is None  # this replica's copy says 10.0
    with pytest.raises(FailedPrecondition, match=r"revoked \(ttl_expired\)"):
        here.release(lease.lease_id, "D", 0, now=2.0)
    assert here.revoke_expired(now=2.0, limit=10) == [lease]  # reported once, so both sides hear of it
    assert lease.state is LeaseState.REVOKED and here.revoke_expired(now=3.0, limit=10) == []


async def test_a_replica_drops_its_copy_of_an_engine_another_replica_ended(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the fleet's notice can drop the copy within this test: the copy's own age limit is long.
    monkeypatch.setattr(state_redis_fleet, "SEEN_FOR_S", 60.0)
    async with two_replicas(redis_server.url, f"seen{secrets.token_hex(3)}") as ((_, stub_a), (_, stub_b)):
        p, d = RawSession(stub_a), RawSession(stub_b)
        reg = await p.register(engine_info("P"), 60_000)
        await d.register(engine_info("D"), 60_000)
        ns = pb.Namespace(layout_id=reg.layout_id)
        first = hold_request(ns, H, "first")
        first.reader_engine_id = "D"
        held = await stub_a.Hold(first)  # replica a reads D's record from the store and keeps it
        assert held.lease.reader_engine_id == "D"
        await d.close()  # D's session ends on replica b
        deadline = time.monotonic() + 5.0
        while True:
            again = hold_request(ns, H, f"again-{time.monotonic()}")
            again.reader_engine_id = "D"
            try:
                await stub_a.Hold(again)
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.NOT_FOUND, err
                break
            assert time.monotonic() < deadline, "replica a still names the ended engine D"
            await asyncio.sleep(0.02)
        await p.close()


def test_the_direct_connection_reconnects_and_reloads_scripts_after_a_restart(
    own_redis: RedisServer,
) -> None:
    store = own_redis  # this test stops it
    state = redis_state(store)
    script = state.script("return {ARGV[1], redis.call('INCR', KEYS[1])}")
    assert state.run(script, ["k"], ["x"]) == [b"x", 1]
    assert state.command("PUBLISH", "ch", "body") == 0
    store.stop()
    with pytest.raises(Unavailable, match="does not answer"):
        state.run(script, ["k"], ["x"])
    store.start()  # the same port, empty: the old connection is dead and the script unknown
    assert wait_for(lambda: not state.health.away, 5.0), "the probe never found the store back"
    assert state.run(script, ["k"], ["y"]) == [b"y", 1]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):  # an error answer keeps the connection
        state.run(state.script("return redis.call('LPUSH', KEYS[1], 1)"), ["k"], [])
    assert state.run(script, ["k"], ["z"]) == [b"z", 2]
    state.close()


async def test_a_lease_end_that_no_hold_takes_reaches_the_holder_by_a_nudge(
    redis_server: RedisServer,
) -> None:
    prefix = f"route{secrets.token_hex(3)}"
    listener = redis.asyncio.Redis.from_url(redis_server.url)
    pubsub = listener.pubsub(ignore_subscribe_messages=True)
    await pubsub.psubscribe(f"{prefix}:{{fleet}}:notify*")
    async with two_replicas(redis_server.url, prefix) as ((a, stub_a), (_, stub_b)):
        p, d = RawSession(stub_a), RawSession(stub_b)
        reg = await p.register(engine_info("P"), 60_000)
        await d.register(engine_info("D"), 60_000)
        request = hold_request(pb.Namespace(layout_id=reg.layout_id), H, "routed")
        request.reader_engine_id = "D"
        held = await stub_a.Hold(request)
        lid = held.lease.lease_id
        acquired = await stub_b.Acquire(pb.AcquireRequest(lease_id=lid, reader_engine_id="D"))
        await stub_b.Release(
            pb.ReleaseRequest(lease_id=lid, reader_engine_id="D", epoch=acquired.lease.epoch)
        )
        ended = (await p.read_kind("lease_ended")).lease_ended.lease  # told across replicas
        assert (ended.lease_id, ended.state, ended.block_hashes) == (lid, pb.LEASE_RELEASED, H[:4])
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            msg = await pubsub.get_message(timeout=0.5)
            assert msg is None or b'"k": "ended"' not in msg["data"]  # not published: in P's inbox
            if msg is not None and b'"k": "ends"' in msg["data"]:
                # P made no hold that took it from its inbox in the store: a, which serves P,
                # was nudged on its own channel (not every replica), took it and sent it.
                assert msg["channel"] == f"{prefix}:{{fleet}}:notify:{a.notifier.replica}".encode()  # type: ignore[attr-defined]
                assert a.notifier.delivered == 1  # type: ignore[attr-defined]
                break
        else:
            raise AssertionError("no nudge was published")
        await p.close()
        await d.close()
    await pubsub.aclose()
    await listener.aclose()


def test_an_expiry_pass_asks_the_store_only_when_something_may_be_due(redis_server: RedisServer) -> None:
    state = redis_state(redis_server)
    here, there = RedisLeaseTable(state), RedisLeaseTable(state)
    passes = []  # the expiry scripts that reached the store
    run = state.run

    def counted(script: object, keys: list[str], args: list[object]) -> object:
        if script is here._expire_due:
            passes.append(args[1])
        return run(script, keys, args)

    state.run = counted  # type: ignore[method-assign]

    def create(table: RedisLeaseTable, deadline: float) -> Lease:
        return table.create(
            holder="P",
            reader="D",
            namespace=Namespace("layout", ""),
            tier=Tier.GPU,
            block_hashes=[1],
            block_ids=[2],
            state=LeaseState.HELD,
            ttl_s=deadline,
            deadline=deadline,
            request_id="",
        )

    create(here, 10.0)
    assert here.revoke_expired(now=1.0, limit=10) == [] and len(passes) == 1  # a first pass asks
    assert here.revoke_expired(now=1.1, limit=10) == [] and len(passes) == 1  # nothing due: no call
    due = create(there, 1.15)  # set by another replica since: that one's to meet, or ours ...
    assert here.revoke_expired(now=1.2, limit=10) == [] and len(passes) == 1
    ended = here.revoke_expired(now=1.3, limit=10)  # ... within 0.25 s of the last pass
    assert [lease.lease_id for lease in ended] == [due.lease_id] and len(passes) == 2
    mine = create(here, 1.35)  # set here: asked once due, not 0.25 s after the last pass
    assert here.revoke_expired(now=1.34, limit=10) == [] and len(passes) == 2
    assert here.revoke_expired(now=1.36, limit=10) == [mine] and len(passes) == 3
