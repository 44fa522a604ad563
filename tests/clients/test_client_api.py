"""The client library against a real in-process broker over real gRPC."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio
import pytest

from kvbroker.clients import errors
from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.clients.clock import Backoff
from kvbroker.clients.engine_session import EngineSession
from kvbroker.clients.sync import BrokerClient
from kvbroker.clients.threaded_session import ThreadedEngineSession
from kvbroker.common.hashing import wire_chain
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import running_broker
from testkit.clock import ManualClock
from testkit.waiting import until

GPU = pb.TIER_GPU
CHAIN = wire_chain(list(range(32 * 6)), 32)  # six full blocks


@pytest.fixture
async def client(broker: Any) -> AsyncIterator[AsyncBrokerClient]:
    async with AsyncBrokerClient(broker.address) as c:
        yield c


async def test_unary_errors_are_typed(client: AsyncBrokerClient) -> None:
    with pytest.raises(errors.NotFound, match="lease"):
        await client.revoke(lease_id="no-such-lease")
    with pytest.raises(errors.NotFound, match="engine"):
        await client.hold(
            holder_engine_id="ghost",
            namespace=pb.Namespace(layout_id="x"),
            tier=GPU,
            block_hashes=[1],
            block_ids=[1],
        )
    with pytest.raises(errors.InvalidArgument):
        await client.resolve(namespace=pb.Namespace(), block_hashes=[1])
    stats = await client.stats()
    assert stats.engines == 0


async def test_unreachable_broker_is_unavailable() -> None:
    async with AsyncBrokerClient("127.0.0.1:1", timeout=1.0) as c:
        with pytest.raises(errors.Unavailable):
            await c.stats()
    with BrokerClient("127.0.0.1:1", timeout=1.0) as sync_client, pytest.raises(errors.Unavailable):
        sync_client.stats()


async def test_register_announce_and_resolve_over_the_session(
    sessions: Callable[..., Any], client: AsyncBrokerClient
) -> None:
    holder = await sessions("p0", flush_interval_s=0.01)
    reader = await sessions("d0")
    assert holder.layout_id and holder.layout_id == reader.layout_id
    assert holder.registered.session_ttl_ms == 2_000
    ns = (holder.layout_id, "")
    holder.announce_stored(ns, GPU, CHAIN[:4])
    holder.announce_stored(ns, GPU, CHAIN[4:5])
    holder.announce_removed(ns, GPU, CHAIN[4:5])  # undone before the flush
    await until(lambda: holder.inventory.pending_count == 0)
    await holder.applied()  # the timed flush is on the wire; the broker has applied it
    response = await reader.resolve(ns, CHAIN)
    assert [(m.engine_id, m.tier, m.matched_blocks) for m in response.matches] == [("p0", GPU, 4)]
    # The tenant is part of the namespace: another tenant sees nothing.
    other = await reader.resolve((holder.layout_id, "tenant-b"), CHAIN)
    assert not other.matches and other.skipped_reason == "no_holder"
    engines = {e.engine_id: e for e in (await client.list_engines()).engines}
    assert engines["p0"].blocks_gpu == 4


async def test_hold_acquire_release_tells_the_holder(
    sessions: Callable[..., Any], recorder: Callable[[], Any]
) -> None:
    p_events = recorder()
    holder = await sessions("p0", **p_events.callbacks())
    reader = await sessions("d0")
    ns = (holder.layout_id, "")
    lease = await holder.hold(ns, GPU, CHAIN[:3], [7, 8, 9], ttl_ms=5_000, reader_engine_id="d0")
    assert lease.state == pb.LEASE_HELD
    acquired = await reader.acquire(lease.lease_id, ttl_ms=5_000)
    assert acquired.lease.state == pb.LEASE_ACTIVE
    assert list(acquired.lease.block_ids) == [7, 8, 9]
    assert acquired.holder.ranks[0].agent_name == "p0-agent"
    released = await reader.release(lease.lease_id)
    assert released.state == pb.LEASE_RELEASED
    (ended,) = await p_events.wait_for("lease_ended")
    assert ended.lease.lease_id == lease.lease_id and ended.lease.state == pb.LEASE_RELEASED
    with pytest.raises(errors.FailedPrecondition) as info:
        await reader.release(lease.lease_id)
    assert info.value.cause == "released"


async def test_operator_revoke_reaches_both_sides(
    sessions: Callable[..., Any], recorder: Callable[[], Any], client: AsyncBrokerClient
) -> None:
    p_events, d_events = recorder(), recorder()
    holder = await sessions("p0", **p_events.callbacks())
    reader = await sessions("d0", **d_events.callbacks())
    lease = await holder.hold((holder.layout_id, ""), GPU, CHAIN[:2], [1, 2], ttl_ms=5_000)
    await reader.acquire(lease.lease_id)
    await client.revoke(lease_id=lease.lease_id, reason="test")
    (revoked,) = await d_events.wait_for("revoked")
    assert revoked.cause == pb.REVOKE_OPERATOR and revoked.lease.lease_id == lease.lease_id
    (ended,) = await p_events.wait_for("lease_ended")
    assert ended.lease.state == pb.LEASE_REVOKED
    with pytest.raises(errors.FailedPrecondition) as info:
        await reader.release(lease.lease_id)
    assert info.value.cause == "operator"
    listed = await client.list_leases(include_ended=True)
    assert [lease_.cause for lease_ in listed.leases if lease_.lease_id == lease.lease_id] == [
        pb.REVOKE_OPERATOR
    ]


async def test_closing_the_reader_session_revokes_its_lease(
    sessions: Callable[..., Any], recorder: Callable[[], Any]
) -> None:
    p_events = recorder()
    holder = await sessions("p0", **p_events.callbacks())
    reader = await sessions("d0")
    lease = await holder.hold((holder.layout_id, ""), GPU, CHAIN[:2], [1, 2], ttl_ms=60_000)
    await reader.acquire(lease.lease_id)
    await reader.close()
    (ended,) = await p_events.wait_for("lease_ended")
    assert ended.lease.cause == pb.REVOKE_READER_GONE


async def test_resolve_with_acquire_pins_through_on_pin(sessions: Callable[..., Any]) -> None:
    pins: list[pb.PinCommand] = []

    async def on_pin(command: pb.PinCommand) -> pb.PinResult:
        pins.append(command)
        ids = [100 + i for i in range(len(command.lease.block_hashes))]
        return pb.PinResult(ok=True, block_ids=ids)

    holder = await sessions("p0", on_pin=on_pin)
    reader = await sessions("d0")
    ns = (holder.layout_id, "")
    holder.announce_stored(ns, GPU, CHAIN[:3])
    holder.flush()
    await holder.applied()  # the broker has applied the announcement
    response = await reader.resolve(ns, CHAIN, acquire=True, lease_ttl_ms=5_000)
    assert response.lease.state == pb.LEASE_ACTIVE, response
    assert list(response.lease.block_ids) == [100, 101, 102]
    assert response.holder.engine_id == "p0"
    assert len(pins) == 1 and pins[0].lease.lease_id == response.lease.lease_id
    released = await reader.release(response.lease.lease_id)
    assert released.state == pb.LEASE_RELEASED


async def test_a_refused_pin_gives_no_lease(sessions: Callable[..., Any]) -> None:
    holder = await sessions("p0", on_pin=lambda command: pb.PinResult(ok=False, error="blocks evicted"))
    reader = await sessions("d0")
    ns = (holder.layout_id, "")
    holder.announce_stored(ns, GPU, CHAIN[:2])
    holder.flush()
    await holder.applied()
    response = await reader.resolve(ns, CHAIN, acquire=True)
    assert response.skipped_reason == "holder_refused"
    assert response.lease.state != pb.LEASE_ACTIVE


async def test_applied_returns_once_the_broker_has_every_earlier_change(
    sessions: Callable[..., Any], client: AsyncBrokerClient
) -> None:
    holder = await sessions("p0", flush_interval_s=60.0)  # no timed flush: applied() sends them
    ns = (holder.layout_id, "")
    holder.announce_stored(ns, GPU, range(1, 10_001))  # three messages of at most 4,096 hashes
    holder.announce_removed(ns, GPU, range(1, 5_001))
    holder.announce_stored(ns, pb.TIER_CPU, [7, 8])
    holder.clear_tier(pb.TIER_CPU)
    holder.announce_stored(ns, GPU, [20_000])  # pending when applied() is called
    await holder.applied()
    (engine,) = (await client.list_engines()).engines
    assert (engine.blocks_gpu, engine.blocks_cpu) == (5_001, 0)


async def test_applied_while_disconnected_fails_at_once(engine_info: Callable[..., pb.EngineInfo]) -> None:
    session = EngineSession("127.0.0.1:1", engine_info("p0"))
    await session.start()
    try:
        with pytest.raises(errors.Unavailable, match="no live broker session"):
            await session.applied()
    finally:
        await session.close()


async def test_drain_reaches_the_engine(
    sessions: Callable[..., Any], recorder: Callable[[], Any], client: AsyncBrokerClient
) -> None:
    events = recorder()
    await sessions("p0", **events.callbacks())
    await client.drain(engine_id="p0", reason="maintenance")
    (drain,) = await events.wait_for("drain")
    assert drain.reason == "maintenance"
    engines = (await client.list_engines()).engines
    assert [e.draining for e in engines] == [True]


async def test_watch_streams_engine_events(
    broker: Any, client: AsyncBrokerClient, sessions: Callable[..., Any]
) -> None:
    seen: list[pb.WatchEvent] = []

    async def watch() -> None:
        async for event in client.watch(engine_events=True):
            seen.append(event)
            if event.kind == "engine_registered":
                return

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.1)  # the watch is open before the engine registers
    await sessions("p0")
    await asyncio.wait_for(watcher, 5.0)
    assert seen[-1].engine_id == "p0"


async def test_session_reregisters_and_reannounces_after_broker_restart(
    broker: Any, engine_info: Callable[..., pb.EngineInfo], recorder: Callable[[], Any]
) -> None:

    events = recorder()
    holder = EngineSession(
        broker.address,
        engine_info("p0"),
        ttl_ms=1_000,
        backoff=Backoff(initial_s=0.05, max_s=0.2),
        **events.callbacks(),
    )
    await holder.start(wait_connected_s=5.0)
    ns = (holder.layout_id, "t")
    holder.announce_stored(ns, GPU, CHAIN[:5])
    holder.flush()
    await holder.applied()
    async with AsyncBrokerClient(broker.address) as c:
        before = await c.resolve(
            namespace=pb.Namespace(layout_id=holder.layout_id, tenant="t"), block_hashes=CHAIN
        )
    assert before.matches[0].matched_blocks == 5

    await broker.stop(0)
    await events.wait_for("disconnected")
    async with running_broker(
        address=f"127.0.0.1:{broker.port}", shutdown_grace_s=0.1, stop_grace=0.1
    ) as restarted:
        try:
            await events.wait_for("connected", count=2, timeout=10.0)
            assert holder.registrations == 2
            # The re-announcement went out before the session counted as connected.
            await holder.applied()
            async with AsyncBrokerClient(restarted.address) as c:
                after = await c.resolve(
                    namespace=pb.Namespace(layout_id=holder.layout_id, tenant="t"), block_hashes=CHAIN
                )
            assert [(m.engine_id, m.matched_blocks) for m in after.matches] == [("p0", 5)]
        finally:
            await holder.close()


async def test_resolve_while_disconnected_fails_at_once(engine_info: Callable[..., pb.EngineInfo]) -> None:
    session = EngineSession("127.0.0.1:1", engine_info("p0"))
    await session.start()
    started = time.monotonic()
    with pytest.raises(errors.Unavailable):
        await session.resolve(("L", ""), CHAIN)
    assert time.monotonic() - started < 1.0  # not its reconnect backoff (loose: CI machines are loaded)
    session.announce_stored(("", ""), GPU, CHAIN)  # kept in the mirror, never blocks
    assert session.inventory.total_held() == len(CHAIN)
    await session.close()


async def test_bad_registration_is_fatal_not_retried(
    broker: Any, engine_info: Callable[..., pb.EngineInfo]
) -> None:
    session = EngineSession(broker.address, engine_info("p0", block_size=0))
    await session.start()
    with pytest.raises(errors.InvalidArgument, match="block_size"):
        await session.wait_connected(5.0)
    assert session.fatal_error is not None and session.registrations == 0
    await session.close()


class _SilentBroker(broker_pb2_grpc.KVBrokerServicer):
    """Registers engines, then never says anything again (a hung broker)."""

    def __init__(self) -> None:
        self.registrations = 0

    async def Session(self, request_iterator: Any, context: Any) -> Any:
        async for message in request_iterator:
            if message.WhichOneof("msg") == "register":
                self.registrations += 1
                yield pb.SessionDown(
                    seq=message.seq,
                    registered=pb.Registered(
                        session_id="s", layout_id="L", session_ttl_ms=400, heartbeat_interval_ms=130
                    ),
                )


async def test_session_gives_up_after_three_silent_ttls_and_reconnects(
    engine_info: Callable[..., pb.EngineInfo], recorder: Callable[[], Any]
) -> None:
    server = grpc.aio.server()
    silent = _SilentBroker()
    broker_pb2_grpc.add_KVBrokerServicer_to_server(silent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    events = recorder()
    session = EngineSession(
        f"127.0.0.1:{port}",
        engine_info("p0"),
        backoff=Backoff(initial_s=0.01, max_s=0.05),
        **events.callbacks(),
    )
    try:
        started = time.monotonic()
        await session.start(wait_connected_s=5.0)
        (error,) = await events.wait_for("disconnected", timeout=5.0)
        gave_up_after = time.monotonic() - started
        assert isinstance(error, errors.Unavailable) and "answered nothing" in error.message
        # SILENCE_TTLS (3) TTLs of 0.4 s: the broker, not this side, decides a session's end.
        assert 1.2 <= gave_up_after < 2.3
        await events.wait_for("connected", count=2, timeout=3.0)
        assert silent.registrations >= 2
    finally:
        await session.close()
        await server.stop(0)


async def test_threaded_session_never_blocks_the_caller(
    broker: Any, engine_info: Callable[..., pb.EngineInfo]
) -> None:
    # The broker runs on this test's loop; the sessions run on their own threads,
    # and this test only ever waits on their futures through the loop.
    holder = ThreadedEngineSession(broker.address, engine_info("p0"))
    reader = ThreadedEngineSession(broker.address, engine_info("d0"))
    await asyncio.to_thread(holder.start, 5.0)
    await asyncio.to_thread(reader.start, 5.0)
    try:
        assert holder.connected and reader.connected
        ns = (holder.layout_id, "")
        started = time.monotonic()
        holder.announce_stored(ns, GPU, CHAIN[:4])
        future = reader.resolve_async(ns, CHAIN)
        # Neither call waited for the broker: it runs on this loop, which this code has not yet
        # yielded, so a call that waited could not have returned at all (the bound only guards a hang).
        assert time.monotonic() - started < 1.0
        assert isinstance(future, concurrent.futures.Future)
        response = await asyncio.wrap_future(future)
        await asyncio.to_thread(holder.applied)  # blocks its caller until the broker applied the announce
        response = await asyncio.wrap_future(reader.resolve_async(ns, CHAIN))
        assert response.matches[0].matched_blocks == 4
        lease = await asyncio.wrap_future(
            holder.hold(ns, GPU, CHAIN[:2], [3, 4], 5_000, reader_engine_id="d0")
        )
        acquired = await asyncio.wrap_future(reader.acquire(lease.lease_id))
        assert acquired.lease.state == pb.LEASE_ACTIVE
        released = await asyncio.wrap_future(reader.release(lease.lease_id))
        assert released.state == pb.LEASE_RELEASED
    finally:
        await asyncio.to_thread(holder.close)
        await asyncio.to_thread(reader.close)
    # After close, calls neither raise into the caller nor hang: they fail through their future.
    holder.announce_stored(ns, GPU, CHAIN)
    late = reader.resolve_async(ns, CHAIN)
    with pytest.raises(errors.Unavailable):
        late.result(timeout=1.0)
    assert not holder.connected
    with pytest.raises(errors.Unavailable):
        holder.applied(timeout=1.0)


class _MetadataRecorder(broker_pb2_grpc.KVBrokerServicer):
    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        return pb.StatsResponse(engines=7)


async def test_trace_context_travels_in_call_metadata() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    server = grpc.aio.server()
    recorder = _MetadataRecorder()
    broker_pb2_grpc.add_KVBrokerServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncBrokerClient(f"127.0.0.1:{port}") as c:
            assert (await c.stats()).engines == 7  # no current span: no traceparent
            with TracerProvider().get_tracer("test").start_as_current_span("router") as span:
                await c.stats()
        assert "traceparent" not in recorder.metadata[0]
        trace_id = format(span.get_span_context().trace_id, "032x")
        assert recorder.metadata[1]["traceparent"].split("-")[1] == trace_id
    finally:
        await server.stop(0)


class _RecordingBroker(broker_pb2_grpc.KVBrokerServicer):
    """Registers engines and records every SessionUp message it receives."""

    def __init__(self) -> None:
        self.received: list[pb.SessionUp] = []

    async def Session(self, request_iterator: Any, context: Any) -> Any:
        async for message in request_iterator:
            self.received.append(message)
            if message.WhichOneof("msg") == "register":
                yield pb.SessionDown(
                    seq=message.seq,
                    registered=pb.Registered(session_id="s", layout_id="L", session_ttl_ms=10_000),
                )

    def inventory(self) -> list[pb.InventoryUpdate]:
        return [m.inventory for m in self.received if m.WhichOneof("msg") == "inventory"]


async def test_a_busy_engine_sends_few_inventory_messages(engine_info: Callable[..., pb.EngineInfo]) -> None:
    server = grpc.aio.server()
    recording = _RecordingBroker()
    broker_pb2_grpc.add_KVBrokerServicer_to_server(recording, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    session = EngineSession(
        f"127.0.0.1:{port}", engine_info("p0"), flush_interval_s=0.005, flush_max_hashes=1024
    )
    try:
        await session.start(wait_connected_s=5.0)
        for h in range(3000):  # one block at a time, as a scheduler would
            session.announce_stored(("L", ""), GPU, [h])
        for h in range(0, 3000, 2):
            session.announce_removed(("L", ""), GPU, [h])
        await until(lambda: sum(len(u.stored) - len(u.removed) for u in recording.inventory()) == 1500)
        updates = recording.inventory()
        # 4,500 calls: a message per 1,024 pending hashes plus the timed flush of the rest.
        assert len(updates) <= 6, [len(u.stored) + len(u.removed) for u in updates]
        stored = set().union(*(set(u.stored) for u in updates)) - set().union(
            *(set(u.removed) for u in updates)
        )
        assert stored == set(range(1, 3000, 2))
        assert all(m.seq > 0 for m in recording.received)
        # Blocks stored and evicted again before the flush cost no message at all.
        for h in range(10_000, 10_500):
            session.announce_stored(("L", ""), GPU, [h])
            session.announce_removed(("L", ""), GPU, [h])
        await asyncio.sleep(0.05)
        assert len(recording.inventory()) == len(updates)
    finally:
        await session.close()
        await server.stop(0)


async def test_applied_flushes_then_waits_for_the_ack_of_a_heartbeat_sent_behind(
    engine_info: Callable[..., pb.EngineInfo],
) -> None:
    server = grpc.aio.server()
    recording = _RecordingBroker()  # acknowledges nothing
    broker_pb2_grpc.add_KVBrokerServicer_to_server(recording, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # A clock that stands still: no heartbeat of the session's own on the wire.
    session = EngineSession(
        f"127.0.0.1:{port}", engine_info("p0"), flush_interval_s=60.0, clock=ManualClock()
    )
    try:
        await session.start(wait_connected_s=5.0)
        session.announce_stored(("L", ""), GPU, [1, 2, 3])
        with pytest.raises(errors.DeadlineExceeded):
            await session.applied(timeout=0.2)
        await until(lambda: len(recording.received) == 3)
        register, inventory, heartbeat = recording.received
        assert [m.WhichOneof("msg") for m in recording.received] == ["register", "inventory", "heartbeat"]
        assert list(inventory.inventory.stored) == [1, 2, 3]
        assert register.seq < inventory.seq < heartbeat.seq
        # The stream breaks before the acknowledgement: the barrier fails, it never passes.
        waiting = asyncio.ensure_future(session.applied(timeout=30.0))
        await until(lambda: len(recording.received) == 4)
        await server.stop(0)
        with pytest.raises(errors.Unavailable):
            await asyncio.wait_for(waiting, 10.0)
    finally:
        await session.close()
        await server.stop(0)
