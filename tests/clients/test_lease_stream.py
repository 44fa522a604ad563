"""Lease commands on the session stream, against a real broker: answered in stream order, as this engine only."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest

from kvbroker.clients import errors
from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.clients.engine_session import LeaseCommand
from kvbroker.clients.threaded_session import ThreadedEngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit.waiting import until

pytestmark = pytest.mark.timeout(60)
GPU = pb.TIER_GPU


def _lease_of_request(broker: Any, holder: str, request_id: str) -> str:
    for lease in broker.core.leases.by_holder(holder):
        if lease.request_id == request_id:
            return str(lease.lease_id)
    return ""


async def test_the_holder_hears_its_hold_answered_before_that_lease_ends(broker: Any, sessions: Any) -> None:
    """Claimed, read and released the instant it exists, a hold still answers its holder first."""
    holds: dict[str, concurrent.futures.Future[Any]] = {}
    order: list[tuple[str, bool]] = []

    def ended(message: pb.LeaseEnded) -> None:
        # Runs on the session's loop as the message is dispatched: the hold must be settled by then.
        future = holds[message.lease.request_id]
        order.append((message.lease.request_id, future.done()))

    p = await sessions("P", on_lease_ended=ended)
    d = await sessions("D")
    for i in range(200):
        request_id = f"req-{i}"
        holds[request_id] = p.send_lease_command(
            p.hold_command((p.layout_id, ""), GPU, [1000 + i], [i], 30_000, request_id=request_id)
        )
        # The broker handles P's hold; D claims it at once, before P reads anything.
        while not (lease_id := _lease_of_request(broker, "P", request_id)):
            await asyncio.sleep(0)
        claimed = await d.acquire(lease_id, 5_000)
        assert claimed.holder.engine_id == "P"
        released = await d.release(lease_id, claimed.lease.epoch)
        assert released.state == pb.LEASE_RELEASED
        await until(lambda rid=request_id: any(r == rid for r, _ in order))  # type: ignore[misc]
        assert (await asyncio.wrap_future(holds[request_id])).lease_id == lease_id
    assert len(order) == 200
    assert all(settled for _, settled in order), [r for r, settled in order if not settled]


async def test_a_lease_command_naming_another_engine_is_refused_in_band(broker: Any, sessions: Any) -> None:
    p = await sessions("P")
    await sessions("Q")
    other = pb.HoldRequest(
        holder_engine_id="Q", namespace=pb.Namespace(layout_id=p.layout_id), block_hashes=[7], block_ids=[7]
    )
    refused = p.send_lease_command(LeaseCommand("hold", pb.SessionUp(hold=other), lambda r: r))
    with pytest.raises(errors.PermissionDenied, match="acts only as itself") as caught:
        await asyncio.wrap_future(refused)
    assert caught.value.cause == "not_yours"
    for command in (
        pb.SessionUp(acquire=pb.AcquireRequest(lease_id="x", reader_engine_id="Q")),
        pb.SessionUp(renew=pb.RenewRequest(lease_id="x", engine_id="Q")),
        pb.SessionUp(release=pb.ReleaseRequest(lease_id="x", reader_engine_id="Q")),
    ):
        with pytest.raises(errors.PermissionDenied) as caught:
            await p._request(command, 5.0, "test")
        assert caught.value.cause == "not_yours"
    # The session goes on, and naming itself is the same as naming nobody.
    own = pb.HoldRequest(
        holder_engine_id="P",
        namespace=pb.Namespace(layout_id=p.layout_id),
        tier=GPU,
        block_hashes=[7],
        block_ids=[7],
        ttl_ms=5_000,
    )
    answer = await p._request(pb.SessionUp(hold=own), 5.0, "test")
    assert answer.lease.holder_engine_id == "P"
    assert p.connected


async def test_lease_errors_keep_their_cause_and_the_unary_calls_still_work(
    broker: Any, sessions: Any
) -> None:
    p = await sessions("P")
    d = await sessions("D")
    with pytest.raises(errors.NotFound) as caught:
        await d.acquire("no-such-lease")
    assert caught.value.cause == "unknown_lease"
    lease = await p.hold((p.layout_id, ""), GPU, [5], [5], 30_000, request_id="r1")
    async with AsyncBrokerClient(broker.address) as client:  # a router, on the unary call
        declined = await client.decline(holder_engine_id="P", request_id="r1")
    assert declined.lease.lease_id == lease.lease_id
    again = await d.decline("P", "r1")  # on D's stream: names the holder, another engine
    assert not again.HasField("lease")


async def test_lease_commands_fail_at_once_without_a_stream(broker: Any, engine_info: Any) -> None:
    from kvbroker.clients.engine_session import EngineSession

    session = EngineSession(broker.address, engine_info("P"))  # never started
    with pytest.raises(errors.Unavailable):
        await session.hold(("layout", ""), GPU, [1], [1], 1_000)
    future = session.send_lease_command(session.release_command("x"))
    assert isinstance(future.exception(timeout=0), errors.Unavailable)


async def test_the_threaded_session_settles_its_hold_before_the_lease_end_callback(
    broker: Any, engine_info: Any
) -> None:
    # The broker runs on this test's loop; the sessions on their own threads.
    seen: list[bool] = []
    holds: dict[str, concurrent.futures.Future[Any]] = {}
    holder = ThreadedEngineSession(
        broker.address,
        engine_info("p0"),
        on_lease_ended=lambda m: seen.append(holds[m.lease.request_id].done()),
    )
    reader = ThreadedEngineSession(broker.address, engine_info("d0"))
    await asyncio.to_thread(holder.start, 5.0)
    await asyncio.to_thread(reader.start, 5.0)

    async def done(future: concurrent.futures.Future[Any]) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(future), 5)

    try:
        for i in range(20):
            rid = f"t-{i}"
            holds[rid] = holder.hold((holder.layout_id, ""), GPU, [2000 + i], [i], 30_000, request_id=rid)
            while not (lease_id := _lease_of_request(broker, "p0", rid)):
                await asyncio.sleep(0)
            claimed = await done(reader.acquire(lease_id, 5_000))
            assert (await done(reader.release(lease_id, claimed.lease.epoch))).state == pb.LEASE_RELEASED
            assert (await done(holds[rid])).lease_id == lease_id
        await until(lambda: len(seen) == 20)
        kept = await done(holder.hold((holder.layout_id, ""), GPU, [3000], [1], 30_000, request_id="r"))
        assert (await done(holder.renew(kept.lease_id, 10_000))).lease_id == kept.lease_id
        with pytest.raises(errors.NotFound):
            await done(reader.release("no-such-lease"))
        assert (await done(reader.decline("p0", "r"))).lease.lease_id == kept.lease_id
    finally:
        await asyncio.to_thread(holder.close)
        await asyncio.to_thread(reader.close)
    assert all(seen), seen
    failed = holder.hold((holder.layout_id, ""), GPU, [1], [1], 1_000)
    assert isinstance(failed.exception(timeout=1), errors.Unavailable)


async def test_a_traced_lease_command_gets_the_broker_span_its_unary_twin_would(engine_info: Any) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvbroker.broker.config import BrokerConfig
    from kvbroker.broker.server import start_server

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    running = await start_server(BrokerConfig(address="127.0.0.1:0"), tracer_provider=provider)
    caller = TracerProvider().get_tracer("test")
    holder = ThreadedEngineSession(running.address, engine_info("p0"))
    try:
        await asyncio.to_thread(holder.start, 5.0)
        with caller.start_as_current_span("pull") as pull:
            future = holder.hold((holder.layout_id, ""), GPU, [1], [1], 5_000)
        lease = await asyncio.wait_for(asyncio.wrap_future(future), 5)
        untraced = await asyncio.wait_for(asyncio.wrap_future(holder.renew(lease.lease_id, 6_000)), 5)
        assert untraced.lease_id == lease.lease_id
    finally:
        await asyncio.to_thread(holder.close)
        await running.stop(0.2)
    spans = [s for s in exporter.get_finished_spans() if s.name.startswith("kvbroker.v1.KVBroker/")]
    assert [s.name for s in spans] == ["kvbroker.v1.KVBroker/Hold"]  # the renew carried no trace
    assert spans[0].attributes["rpc.grpc.status_code"] == 0
    assert spans[0].context.trace_id == pull.get_span_context().trace_id
    assert spans[0].parent is not None and spans[0].parent.span_id == pull.get_span_context().span_id
