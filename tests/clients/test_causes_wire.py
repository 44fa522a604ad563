"""Every cause the broker reports reaches the client as the same cause.

One scenario per cause of the vocabulary (kvbroker.common.causes), each
against a real in-process broker over real gRPC, through the client library
(AsyncBrokerClient, EngineSession, or a raw stream mapped by
kvbroker.clients.errors): a unary call's ErrorInfo, a stream the broker ends,
and a SessionError answering one session message.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvbroker.broker.security.config import SecurityConfig
from kvbroker.clients import errors
from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.clients.engine_session import EngineSession
from kvbroker.clients.sync import BrokerClient
from kvbroker.common.causes import CAUSES, Cause
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import RunningServer, running_broker
from testkit.redis_server import missing_reason, running_redis
from testkit.waiting import until
from tests.broker.session_util import RawSession
from tests.clients.conftest import make_engine_info

GPU = pb.TIER_GPU
H = list(range(7000, 7008))
IDS = list(range(8))
NOT_ERRORS = {Cause.NO_HOLDER, Cause.BELOW_MIN}
# Who-is-calling causes need a broker with credentials: tests/broker/security runs every
# RPC as every caller against real TLS and token brokers and checks these words.
CALLER_CAUSES = {
    Cause.UNAUTHENTICATED,
    Cause.ROLE_DENIED,
    Cause.OTHER_TENANT,
    Cause.SESSION_OWNED,
    Cause.QUOTA_EXCEEDED,
}


@dataclass
class World:
    """A broker with two engines of one layout: P holds, D reads."""

    broker: RunningServer
    client: AsyncBrokerClient
    p: EngineSession
    d: EngineSession
    ns: pb.Namespace
    open_session: Callable[..., Awaitable[EngineSession]]
    start_broker: Callable[..., Awaitable[RunningServer]]

    async def hold(self, reader: str = "D", **kw: Any) -> pb.Lease:
        return await self.p.hold(self.ns, GPU, H[:4], IDS[:4], 5_000, reader_engine_id=reader, **kw)

    async def ended(self, lease_id: str) -> None:
        async def gone() -> bool:
            listed = await self.client.list_leases(include_ended=True)
            return any(
                lease.lease_id == lease_id and lease.state in (pb.LEASE_REVOKED, pb.LEASE_RELEASED)
                for lease in listed.leases
            )

        for _ in range(200):
            if await gone():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"lease {lease_id} did not end")

    def raw(self, broker: RunningServer | None = None) -> tuple[RawSession, grpc.aio.Channel]:
        channel = grpc.aio.insecure_channel((broker or self.broker).address)
        return RawSession(broker_pb2_grpc.KVBrokerStub(channel)), channel


async def refused(call: Awaitable[Any]) -> errors.BrokerError:
    with pytest.raises(errors.BrokerError) as info:
        await call
    return info.value


async def stream_end(raw: RawSession) -> errors.BrokerError:
    """Read a raw session until the broker ends it: its last SessionError must say what the status says."""
    last: pb.SessionDown | None = None
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while True:
            down = await raw.read()
            if down.WhichOneof("msg") == "error":
                last = down
    err = errors.from_rpc_error(info.value)
    assert last is not None and last.seq == 0  # unsolicited: the stream's end
    in_band = errors.from_session_error(last.error)
    assert (type(in_band), in_band.cause, in_band.metadata) == (type(err), err.cause, err.metadata)
    return err


# -- one scenario per cause ---------------------------------------------------------

Scenario = Callable[[World], Awaitable[errors.BrokerError]]
SCENARIOS: dict[Cause, Scenario] = {}


def scenario(cause: Cause) -> Callable[[Scenario], Scenario]:
    def add(fn: Scenario) -> Scenario:
        SCENARIOS[cause] = fn
        return fn

    return add


@scenario(Cause.TTL_EXPIRED)
async def _ttl_expired(w: World) -> errors.BrokerError:
    lease = await w.hold()
    await w.d.acquire(lease.lease_id, ttl_ms=100)
    await asyncio.sleep(0.25)
    return await refused(w.d.release(lease.lease_id))


@scenario(Cause.READER_GONE)
async def _reader_gone(w: World) -> errors.BrokerError:
    reader = await w.open_session("R")
    lease = await w.hold(reader="R")
    await reader.close()
    await w.ended(lease.lease_id)
    return await refused(w.p.renew(lease.lease_id))


@scenario(Cause.HOLDER_GONE)
async def _holder_gone(w: World) -> errors.BrokerError:
    holder = await w.open_session("Q")
    lease = await holder.hold(w.ns, GPU, H[:4], IDS[:4], 5_000, reader_engine_id="D")
    await w.d.acquire(lease.lease_id)
    await holder.close()
    await w.ended(lease.lease_id)
    return await refused(w.d.release(lease.lease_id))


@scenario(Cause.OPERATOR)
async def _operator(w: World) -> errors.BrokerError:
    lease = await w.hold()
    await w.d.acquire(lease.lease_id)
    await w.client.revoke(lease_id=lease.lease_id, reason="test")
    return await refused(w.d.release(lease.lease_id))


@scenario(Cause.HOLDER_REFUSED)
async def _holder_refused(w: World) -> errors.BrokerError:
    w.p.announce_stored(w.ns, GPU, H)  # P has no on_pin: it refuses every pin
    await until(lambda: w.broker.core.index.total_blocks() >= len(H))
    answer = await w.d.resolve(w.ns, H, acquire=True)
    assert answer.skipped_reason == Cause.HOLDER_REFUSED  # in-band, the same word
    listed = await w.client.list_leases(engine_id="D", include_ended=True)
    (lease,) = listed.leases
    return await refused(w.d.renew(lease.lease_id))


@scenario(Cause.DRAIN)
async def _drain(w: World) -> errors.BrokerError:
    lease = await w.hold()
    await w.client.drain(engine_id="P")
    return await refused(w.p.renew(lease.lease_id))


@scenario(Cause.SUPERSEDED)
async def _superseded(w: World) -> errors.BrokerError:
    w.p.announce_stored(w.ns, GPU, H)
    await until(lambda: w.broker.core.index.total_blocks() >= len(H))  # else the removal cancels it unsent
    lease = await w.hold()
    w.p.announce_removed(w.ns, GPU, H[:1])
    await w.ended(lease.lease_id)
    return await refused(w.p.renew(lease.lease_id))


@scenario(Cause.DECLINED)
async def _declined(w: World) -> errors.BrokerError:
    await w.d.decline("P", "req-1")
    return await refused(w.hold(request_id="req-1"))


@scenario(Cause.MEMORY_PRESSURE)
async def _memory_pressure(w: World) -> errors.BrokerError:
    w.p.announce_stored(w.ns, GPU, H)
    await until(lambda: w.broker.core.index.total_blocks() >= len(H))
    w.p.on_pin = lambda cmd: pb.PinResult(lease_id=cmd.lease.lease_id, ok=True, block_ids=IDS[:8])
    lease = (await w.client.retain(namespace=w.ns, block_hashes=H, ttl_ms=5_000)).lease
    w.p.on_pin = None  # P refuses pins again (holder_refused's scenario)
    w.p.give_up_pin(lease.lease_id, "vLLM needed the memory")  # a holder under GPU pressure
    await w.ended(lease.lease_id)
    return await refused(w.client.retain(lease_id=lease.lease_id, ttl_ms=5_000))


@scenario(Cause.RELEASED)
async def _released(w: World) -> errors.BrokerError:
    lease = await w.hold()
    await w.d.acquire(lease.lease_id)
    await w.d.release(lease.lease_id)
    return await refused(w.d.release(lease.lease_id))


@scenario(Cause.STALE_EPOCH)
async def _stale_epoch(w: World) -> errors.BrokerError:
    lease = await w.hold()
    acquired = await w.d.acquire(lease.lease_id)
    err = await refused(w.d.release(lease.lease_id, epoch=acquired.lease.epoch + 5))
    assert err.metadata["epoch"] == str(acquired.lease.epoch)
    return err


@scenario(Cause.WRONG_LEASE_STATE)
async def _wrong_lease_state(w: World) -> errors.BrokerError:
    lease = await w.hold()
    await w.d.acquire(lease.lease_id)
    err = await refused(w.d.acquire(lease.lease_id))
    assert err.metadata == {"lease_id": lease.lease_id, "state": "active"}
    return err


@scenario(Cause.NOT_PARTY)
async def _not_party(w: World) -> errors.BrokerError:
    lease = await w.hold()
    err = await refused(w.client.renew(lease_id=lease.lease_id, engine_id="X"))
    assert err.metadata["engine_id"] == "X"
    return err


@scenario(Cause.NOT_HOLDER)
async def _not_holder(w: World) -> errors.BrokerError:
    lease = await w.hold()
    raw, channel = w.raw()
    async with channel:
        await raw.register(make_engine_info("Q"))
        seq = await raw.send(pin_result=pb.PinResult(lease_id=lease.lease_id, ok=True, block_ids=IDS[:4]))
        down = await raw.read()
        assert down.seq == seq and down.WhichOneof("msg") == "error"
        return errors.from_session_error(down.error)


@scenario(Cause.UNKNOWN_ENGINE)
async def _unknown_engine(w: World) -> errors.BrokerError:
    err = await refused(
        w.client.hold(holder_engine_id="ghost", namespace=w.ns, tier=GPU, block_hashes=[1], block_ids=[1])
    )
    assert err.metadata == {"engine_id": "ghost"}
    return err


@scenario(Cause.UNKNOWN_LEASE)
async def _unknown_lease(w: World) -> errors.BrokerError:
    err = await refused(w.d.renew("no-such-lease"))
    assert err.metadata == {"lease_id": "no-such-lease"}
    return err


@scenario(Cause.NOT_CACHED)
async def _not_cached(w: World) -> errors.BrokerError:
    # Retain a prompt no engine holds a block of: nothing to pin.
    return await refused(
        w.client.retain(namespace=w.ns, block_hashes=H[:4], ttl_ms=5_000, key="nobody-has-it")
    )


@scenario(Cause.UNKNOWN_LAYOUT)
async def _unknown_layout(w: World) -> errors.BrokerError:
    return await refused(w.client.score(namespace=pb.Namespace(layout_id="0" * 16), token_ids=[1] * 64))


@scenario(Cause.LAYOUT_MISMATCH)
async def _layout_mismatch(w: World) -> errors.BrokerError:
    # Over the session: a SessionError answers the resolve, and the session goes on.
    err = await refused(w.d.resolve(pb.Namespace(layout_id="other"), H))
    assert not (await w.d.resolve(w.ns, H)).matches
    return err


@scenario(Cause.INCOMPATIBLE)
async def _incompatible(w: World) -> errors.BrokerError:
    await w.open_session("Q", model="another-model")
    return await refused(w.hold(reader="Q"))


@scenario(Cause.DRAINING)
async def _draining(w: World) -> errors.BrokerError:
    await w.client.drain(engine_id="P")
    return await refused(w.hold())


@scenario(Cause.BAD_REQUEST)
async def _bad_request(w: World) -> errors.BrokerError:
    return await refused(
        w.client.hold(
            holder_engine_id="P", namespace=pb.Namespace(), tier=GPU, block_hashes=[1], block_ids=[1]
        )
    )


@scenario(Cause.OUT_OF_RANGE)
async def _out_of_range(w: World) -> errors.BrokerError:
    return await refused(w.p.hold(w.ns, GPU, H[:4], IDS[:4], 10**9))


@scenario(Cause.SESSION_SUPERSEDED)
async def _session_superseded(w: World) -> errors.BrokerError:
    first, channel = w.raw()
    async with channel:
        await first.register(make_engine_info("E"))
        second, channel2 = w.raw()
        async with channel2:
            await second.register(make_engine_info("E"))
            err = await stream_end(first)
    assert err.metadata == {"engine_id": "E"}
    return err


@scenario(Cause.SESSION_EXPIRED)
async def _session_expired(w: World) -> errors.BrokerError:
    raw, channel = w.raw()
    async with channel:
        await raw.register(make_engine_info("E"), ttl_ms=100)  # and never heartbeats
        return await stream_end(raw)


@scenario(Cause.SHUTTING_DOWN)
async def _shutting_down(w: World) -> errors.BrokerError:
    other = await w.start_broker()
    raw, channel = w.raw(other)
    async with channel, AsyncBrokerClient(other.address) as client:
        await raw.register(make_engine_info("E"))
        events = client.watch(engine_events=True)
        waiting = asyncio.ensure_future(anext(events))
        await until(lambda: other.notifier.watcher_count() == 1)
        await other.stop(0.5)
        session_err = await stream_end(raw)
        watch_err = await refused(waiting)
        assert (type(watch_err), watch_err.cause) == (type(session_err), session_err.cause)
        return session_err


@scenario(Cause.STATE_UNAVAILABLE)
async def _state_unavailable(w: World) -> errors.BrokerError:
    if missing_reason():
        pytest.skip(missing_reason())
    with tempfile.TemporaryDirectory() as workdir, running_redis(Path(workdir)) as store:
        other = await w.start_broker(state=store.url)
        async with AsyncBrokerClient(other.address) as client:
            ns = pb.Namespace(layout_id="L")
            store.stop()  # the shared store goes away: the broker records nothing, says so
            return await refused(
                client.hold(holder_engine_id="E", namespace=ns, tier=GPU, block_hashes=[1], block_ids=[1])
            )


@scenario(Cause.TOO_MANY_WATCHERS)
async def _too_many_watchers(w: World) -> errors.BrokerError:
    other = await w.start_broker(max_watchers=0)
    async with AsyncBrokerClient(other.address) as client:
        err = await refused(anext(client.watch()))
    assert err.metadata == {"limit": "0"}
    return err


@scenario(Cause.WATCHER_BEHIND)
async def _watcher_behind(w: World) -> errors.BrokerError:
    w.broker.notifier._watch_queue = 2  # a watcher 2 events behind is cut off
    events = w.client.watch(lease_events=True, engine_events=True)
    reading = asyncio.ensure_future(anext(events))
    await until(lambda: w.broker.notifier.watcher_count() == 1)
    for _ in range(3):
        await w.hold(reader="")
    await w.client.drain(engine_id="P")  # revokes the three holds at once: 4 events in one step
    with pytest.raises(errors.BrokerError) as info:
        await reading
        while True:
            await anext(events)
    return info.value


@scenario(Cause.TOO_MANY_MIRRORS)
async def _too_many_mirrors(w: World) -> errors.BrokerError:
    other = await w.start_broker(max_mirrors=0)
    async with grpc.aio.insecure_channel(other.address) as channel:
        call = broker_pb2_grpc.KVBrokerStub(channel).Mirror(pb.MirrorRequest(layout_id=w.ns.layout_id))
        with pytest.raises(grpc.RpcError) as info:
            await call.read()
    return errors.from_rpc_error(info.value)


@scenario(Cause.LIMIT_REACHED)
async def _limit_reached(w: World) -> errors.BrokerError:
    other = await w.start_broker(max_lease_blocks=2)
    raw, channel = w.raw(other)
    async with channel, AsyncBrokerClient(other.address) as client:
        reg = await raw.register(make_engine_info("E"))
        ns = pb.Namespace(layout_id=reg.layout_id)
        err = await refused(
            client.hold(holder_engine_id="E", namespace=ns, tier=GPU, block_hashes=H[:3], block_ids=IDS[:3])
        )
    assert err.metadata == {"limit": "2"}
    return err


@scenario(Cause.REGISTER_TIMEOUT)
async def _register_timeout(w: World) -> errors.BrokerError:
    other = await w.start_broker(register_timeout_ms=100)
    async with grpc.aio.insecure_channel(other.address) as channel:
        call = broker_pb2_grpc.KVBrokerStub(channel).Session()  # and never registers
        with pytest.raises(grpc.RpcError) as info:
            await call.read()
    return errors.from_rpc_error(info.value)


@scenario(Cause.NOT_YOURS)
async def _not_yours(w: World) -> errors.BrokerError:
    # The session comes from ::1, the call from 127.0.0.1: two hosts to a broker on [::].
    other = await w.start_broker(address="[::]:0", security=SecurityConfig(insecure=True))
    async with grpc.aio.insecure_channel(f"[::1]:{other.port}") as channel:
        raw = RawSession(broker_pb2_grpc.KVBrokerStub(channel))
        reg = await raw.register(make_engine_info("E"))
        ns = pb.Namespace(layout_id=reg.layout_id)
        async with AsyncBrokerClient(f"127.0.0.1:{other.port}") as client:
            err = await refused(
                client.hold(holder_engine_id="E", namespace=ns, tier=GPU, block_hashes=[1], block_ids=[1])
            )
            held = await client.hold(
                holder_engine_id="E",
                namespace=ns,
                tier=GPU,
                block_hashes=[1],
                block_ids=[1],
                session_id=reg.session_id,
            )
            assert held.lease.holder_engine_id == "E"  # its session id is the proof
    assert err.metadata == {"engine_id": "E"}
    return err


# -- the tests ------------------------------------------------------------------------

BASE = dict(
    address="127.0.0.1:0",
    session_ttl_ms=2_000,
    session_ttl_min_ms=100,
    lease_ttl_ms=5_000,
    pin_timeout_ms=1_000,
    expiry_interval_ms=20,
    shutdown_grace_s=0.2,
)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    opened: list[EngineSession] = []
    async with contextlib.AsyncExitStack() as servers:

        async def start_broker(**overrides: Any) -> RunningServer:
            return await servers.enter_async_context(running_broker(**{**BASE, **overrides}))

        broker = await start_broker()

        async def open_session(engine_id: str, **layout: Any) -> EngineSession:
            session = EngineSession(broker.address, make_engine_info(engine_id, **layout), ttl_ms=2_000)
            opened.append(session)
            await session.start(wait_connected_s=5.0)
            return session

        p = await open_session("P")
        d = await open_session("D")
        client = AsyncBrokerClient(broker.address)
        try:
            yield World(broker, client, p, d, pb.Namespace(layout_id=p.layout_id), open_session, start_broker)
        finally:
            await client.close()
            for session in opened:
                await session.close()


def test_every_cause_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(Cause) - NOT_ERRORS - CALLER_CAUSES


@pytest.mark.parametrize("cause", sorted(SCENARIOS), ids=str)
async def test_the_cause_the_broker_reports_is_the_cause_the_client_sees(world: World, cause: Cause) -> None:
    err = await SCENARIOS[cause](world)
    assert err.cause == cause, f"{cause}: {err!r} {err.message}"
    code = grpc.StatusCode[CAUSES[cause].code]
    assert err.code == code and type(err) is errors.ERROR_OF_STATUS[code]
    assert cause.value not in {"", None} and err.message  # the message stays, for a person


async def test_resolve_outcomes_use_the_same_words(world: World) -> None:
    w = world
    assert (await w.d.resolve(w.ns, H, acquire=True)).skipped_reason == Cause.NO_HOLDER
    w.p.announce_stored(w.ns, GPU, H[:2])
    await until(lambda: w.broker.core.index.total_blocks() >= 2)
    assert (await w.d.resolve(w.ns, H, acquire=True, min_blocks=4)).skipped_reason == Cause.BELOW_MIN


async def test_the_blocking_client_reads_the_cause_too(world: World) -> None:
    lease = await world.hold()
    await world.d.acquire(lease.lease_id)
    await world.d.release(lease.lease_id)

    def release_again() -> errors.BrokerError:
        with BrokerClient(world.broker.address) as client, pytest.raises(errors.BrokerError) as info:
            client.release(lease_id=lease.lease_id, reader_engine_id="D")
        return info.value

    err = await asyncio.to_thread(release_again)
    assert isinstance(err, errors.FailedPrecondition) and err.cause == Cause.RELEASED
    assert err.metadata == {"lease_id": lease.lease_id, "state": "released"}
