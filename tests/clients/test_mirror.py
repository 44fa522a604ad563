"""The index mirror against a real in-process broker over real gRPC: it syncs, follows
every change, answers what the broker answers, and resyncs after a broker restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio
import pytest

from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.clients.clock import Backoff
from kvbroker.clients.engine_session import EngineSession
from kvbroker.clients.mirror import IndexMirror, follow
from kvbroker.common.hashing import wire_chain
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import running_broker
from testkit.clock import FakeClock
from testkit.waiting import until
from tests.clients.conftest import make_engine_info

GPU, CPU = pb.TIER_GPU, pb.TIER_CPU
CHAIN = wire_chain(list(range(32 * 8)), 32)  # eight full blocks
OTHER = wire_chain(list(range(1000, 1000 + 32 * 4)), 32)


@pytest.fixture
async def channel(broker: Any) -> AsyncIterator[grpc.aio.Channel]:
    ch = grpc.aio.insecure_channel(broker.address)
    yield ch
    await ch.close()


def answer(matches: Any) -> list[tuple[str, int, int]]:
    return [(m.engine_id, int(m.tier), m.matched_blocks) for m in matches]


async def broker_answer(
    address: str, layout_id: str, tenant: str, chain: list[int]
) -> list[tuple[str, int, int]]:
    async with AsyncBrokerClient(address) as c:
        response = await c.resolve(
            pb.ResolveRequest(namespace=pb.Namespace(layout_id=layout_id, tenant=tenant), block_hashes=chain)
        )
    return answer(response.matches)


async def test_mirror_follows_the_broker(
    broker: Any, sessions: Any, channel: grpc.aio.Channel, engine_info: Callable[..., pb.EngineInfo]
) -> None:
    p0 = await sessions("p0")
    p1 = await sessions("p1")
    layout = p0.layout_id
    p0.announce_stored((layout, "t"), GPU, CHAIN)
    p1.announce_stored((layout, "t"), CPU, CHAIN[:5])

    async def both_named() -> bool:
        return len(await broker_answer(broker.address, layout, "t", CHAIN)) >= 2

    await until(both_named, message="broker never named the holders")

    mirror = IndexMirror(layout)
    task = asyncio.create_task(follow(mirror, channel))
    try:
        await until(lambda: mirror.synced)
        assert answer(mirror.resolve("t", CHAIN)) == await broker_answer(broker.address, layout, "t", CHAIN)
        assert answer(mirror.resolve("t", CHAIN)) == [("p0", GPU, 8), ("p1", CPU, 5)]
        assert mirror.resolve("other-tenant", CHAIN) == []

        # Live changes: stored, removed, a new engine, an engine gone.
        p1.announce_stored((layout, "t"), GPU, CHAIN[:7])
        await until(lambda: ("p1", GPU, 7) in answer(mirror.resolve("t", CHAIN)))
        p0.announce_removed((layout, "t"), GPU, CHAIN[3:4])
        await until(lambda: ("p0", GPU, 3) in answer(mirror.resolve("t", CHAIN)))
        p2 = await sessions("p2")
        p2.announce_stored((layout, "t"), GPU, OTHER)
        await until(lambda: answer(mirror.resolve("t", OTHER)) == [("p2", GPU, 4)])
        assert {e.engine_id for e in mirror.engines()} == {"p0", "p1", "p2"}
        assert all(not r.agent_metadata for e in mirror.engines() for r in e.ranks)
        await p2.close()
        await until(lambda: mirror.resolve("t", OTHER) == [])
        assert "p2" not in {e.engine_id for e in mirror.engines()}
        assert answer(mirror.resolve("t", CHAIN)) == await broker_answer(broker.address, layout, "t", CHAIN)

        # A busy holder's CPU copy comes before its GPU copy of as much (its GPU pin would wait on
        # its scheduler's step), in the mirror as at the broker, once the load is republished.
        p1.announce_stored((layout, "t"), CPU, CHAIN[:7])
        await until(lambda: answer(mirror.resolve("t", CHAIN))[:2] == [("p1", GPU, 7), ("p1", CPU, 7)])
        p1.set_load(3.0)
        await until(lambda: answer(mirror.resolve("t", CHAIN))[:2] == [("p1", CPU, 7), ("p1", GPU, 7)])
        assert answer(mirror.resolve("t", CHAIN)) == await broker_answer(broker.address, layout, "t", CHAIN)

        # An asker never sees itself, as in a session resolve.
        seen_by_p1 = mirror.resolve("t", CHAIN, asker=engine_info("p1"))
        assert seen_by_p1 is not None and [m.engine_id for m in seen_by_p1] == ["p0"]
        # A holder whose topology the asker cannot read is left out too.
        assert mirror.resolve("t", CHAIN, asker=engine_info("p9", tp_size=2)) == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_empty_layout_is_invalid_argument(channel: grpc.aio.Channel) -> None:
    stub = broker_pb2_grpc.KVBrokerStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Mirror(pb.MirrorRequest()):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "layout_id" in (info.value.details() or "")


async def test_mirror_limit_is_resource_exhausted() -> None:
    async with (
        running_broker(max_mirrors=1, shutdown_grace_s=0.1, stop_grace=0.1) as server,
        grpc.aio.insecure_channel(server.address) as ch,
    ):
        stub = broker_pb2_grpc.KVBrokerStub(ch)
        first = stub.Mirror(pb.MirrorRequest(layout_id="L"))
        assert (await first.read()).reset
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Mirror(pb.MirrorRequest(layout_id="L")):
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-mirrors" in (info.value.details() or "")
        first.cancel()


async def test_mirror_resyncs_after_broker_restart(
    broker: Any, engine_info: Callable[..., pb.EngineInfo]
) -> None:
    holder = EngineSession(
        broker.address, engine_info("p0"), ttl_ms=1_000, backoff=Backoff(initial_s=0.05, max_s=0.2)
    )
    await holder.start(wait_connected_s=5.0)
    layout = holder.layout_id
    holder.announce_stored((layout, ""), GPU, CHAIN)
    mirror = IndexMirror(layout)
    ch = grpc.aio.insecure_channel(broker.address)
    task = asyncio.create_task(follow(mirror, ch, backoff_s=lambda n: 0.05))
    try:
        await until(lambda: mirror.synced and answer(mirror.resolve("", CHAIN)) == [("p0", GPU, 8)])
        syncs = mirror.stats.syncs
        await broker.stop(0.1)
        await until(lambda: not mirror.synced)
        assert mirror.resolve("", CHAIN) is None, "a mirror cut off from the broker must not answer"
        async with running_broker(address=f"127.0.0.1:{broker.port}", shutdown_grace_s=0.1, stop_grace=0.1):
            try:
                # The engine re-registers and re-announces by itself; the mirror resubscribes.
                await until(lambda: mirror.synced and mirror.stats.syncs > syncs, timeout=10)
                await until(lambda: answer(mirror.resolve("", CHAIN) or []) == [("p0", GPU, 8)], timeout=10)
            finally:
                await holder.close()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await ch.close()


def _mirror_with(engines: list[pb.EngineInfo], clock: FakeClock) -> IndexMirror:
    """A synced mirror of layout L fed by hand: `engines`, each holding CHAIN[:4] on its GPU."""
    mirror = IndexMirror("L", silence_s=3.0, clock=clock.now)
    mirror.apply(
        pb.MirrorUpdate(
            reset=True,
            synced=True,
            engines=[pb.MirrorEngine(engine=e) for e in engines],
            blocks=[pb.MirrorBlocks(engine_id=e.engine_id, tier=GPU, stored=CHAIN[:4]) for e in engines],
        )
    )
    return mirror


def test_a_silent_mirror_marks_every_holder_degraded_and_a_keepalive_restores_it() -> None:
    """Injected clock: the mirror judges its own stream's silence as the broker judges an
    engine's; a holder's recorded state (a KV-event feed's lag) shows through otherwise."""
    clock = FakeClock()
    lagging = make_engine_info("feed")
    lagging.exactness, lagging.exactness_reason = pb.INDEX_LAGGING, "replaying batches 4..6"
    mirror = _mirror_with([make_engine_info("p0"), lagging], clock)

    def states() -> dict[str, int]:
        found = mirror.resolve("", CHAIN)
        assert found is not None
        return {m.engine_id: int(m.exactness) for m in found}

    assert states() == {"p0": pb.INDEX_EXACT, "feed": pb.INDEX_LAGGING}  # as the broker recorded them
    assert {s.engine_id: s.exactness for s in mirror.score("", CHAIN) or []} == {
        "p0": pb.INDEX_EXACT,
        "feed": pb.INDEX_LAGGING,
    }
    assert mirror.exactness("feed") == (pb.INDEX_LAGGING, "replaying batches 4..6")
    clock.advance(2.9)  # under the limit: still as recorded, still fresh
    assert mirror.fresh and states() == {"p0": pb.INDEX_EXACT, "feed": pb.INDEX_LAGGING}
    clock.advance(0.2)  # silent for 3.1 s > 3 s
    assert not mirror.fresh and mirror.synced
    assert states() == {"p0": pb.INDEX_DEGRADED, "feed": pb.INDEX_DEGRADED}
    assert {s.exactness for s in mirror.score("", CHAIN) or []} == {pb.INDEX_DEGRADED}
    state, why = mirror.exactness("feed")
    assert state == pb.INDEX_DEGRADED and why == "mirror silent for 3.1 s (limit 3.0 s)"
    mirror.apply(pb.MirrorUpdate())  # the broker's keepalive: nothing changed, but it is alive
    assert mirror.fresh and states() == {"p0": pb.INDEX_EXACT, "feed": pb.INDEX_LAGGING}
    assert mirror.resolve("", CHAIN) is not None and mirror.total_blocks() == 8


async def test_an_idle_mirror_stream_carries_keepalives_and_stays_fresh(
    engine_info: Callable[..., pb.EngineInfo],
) -> None:
    """Real broker, real gRPC: with nothing changing, the stream still delivers an empty update
    every --mirror-keepalive-ms, so a mirror with a silence limit of a few of them stays fresh."""
    async with running_broker(mirror_keepalive_ms=50, shutdown_grace_s=0.1, stop_grace=0.1) as server:
        holder = EngineSession(server.address, engine_info("p0"), ttl_ms=5_000)
        await holder.start(wait_connected_s=5.0)
        mirror = IndexMirror(holder.layout_id, silence_s=30.0)
        async with grpc.aio.insecure_channel(server.address) as ch:
            task = asyncio.create_task(follow(mirror, ch))
            try:
                await until(lambda: mirror.synced)
                after_sync = mirror.stats.updates
                await until(lambda: mirror.stats.updates >= after_sync + 3, message="no keepalives arrived")
                assert mirror.fresh and mirror.silent_for() < 30.0
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await holder.close()
