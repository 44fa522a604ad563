"""A holder's load, from its heartbeats to the engines that read it: Resolve answers name it at
once, mirrors hear of a material change (rate-limited), on both state backends and across
two replicas that share a store."""

from __future__ import annotations

import asyncio
import secrets

import grpc.aio

from kvbroker.broker import observed
from kvbroker.broker.codec import match_pb
from kvbroker.clients.mirror import IndexMirror, follow
from kvbroker.common.model import Namespace, Tier
from kvbroker.common.scoring import load_changed
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import RunningServer, running_broker
from testkit.builders import engine_info
from testkit.redis_server import RedisServer
from testkit.waiting import until
from tests.broker.helpers import make_core
from tests.broker.session_util import RawSession

H = list(range(9100, 9108))


def test_material_change() -> None:
    assert load_changed(0, 1) and load_changed(1, 0) and load_changed(3, 4) and load_changed(10, 12)
    assert not load_changed(10, 11) and not load_changed(0, 0.05) and not load_changed(5, 5)


def loads_heard(sub: object) -> list[tuple[str, float]]:
    return [(e.engine.engine_id, e.engine.load) for u in sub.take() for e in u.engines]  # type: ignore[attr-defined]


def test_heartbeat_load_republished_to_mirrors_when_material_and_rate_limited() -> None:
    core, clock, _ = make_core()
    rec = core.register(engine_info("P"), 0)
    ns = Namespace(rec.layout_id, "")
    core.update_inventory(rec, ns, int(Tier.GPU), H, [])
    sub = core.mirrors.subscribe(rec.layout_id, lambda: None)

    core.heartbeat(rec, 5.0)
    assert loads_heard(sub) == [("P", 5.0)]
    assert [m.load for m in core.resolve(None, ns, H).matches] == [5.0]
    assert match_pb(core.resolve(None, ns, H).matches[0]).load == 5.0, "on the wire too"

    clock.advance(0.1)
    core.heartbeat(rec, 9.0)  # material, but too soon after the last republish
    assert loads_heard(sub) == []
    assert [m.load for m in core.resolve(None, ns, H).matches] == [9.0], "resolve reads it at once"
    clock.advance(observed.LOAD_REPUBLISH_S)
    core.heartbeat(rec, 9.0)  # the held-back change goes out with a later heartbeat
    assert loads_heard(sub) == [("P", 9.0)]

    clock.advance(1.0)
    core.heartbeat(rec, 9.5)  # not material
    assert loads_heard(sub) == []
    core.heartbeat(rec, 0.0)
    assert loads_heard(sub) == [("P", 0.0)]


async def heartbeat(session: RawSession, load: float) -> None:
    """Send a load and wait until the broker has applied it (its ack)."""
    seq = await session.send(heartbeat=pb.Heartbeat(load=load))
    while (down := await session.read_kind("heartbeat_ack")).seq != seq:
        pass
    assert down.seq == seq


async def holder_and_mirror(
    writer: RunningServer, reader: RunningServer, engine: str
) -> tuple[RawSession, pb.Namespace, IndexMirror, asyncio.Task[None], list[grpc.aio.Channel]]:
    """An engine holding H on `writer`, and a mirror of its layout followed on `reader`."""
    channels = [grpc.aio.insecure_channel(writer.address), grpc.aio.insecure_channel(reader.address)]
    session = RawSession(broker_pb2_grpc.KVBrokerStub(channels[0]))
    reg = await session.register(engine_info(engine), 60_000)
    ns = pb.Namespace(layout_id=reg.layout_id)
    await session.announce(ns, pb.TIER_GPU, H)
    await heartbeat(session, 0.0)
    mirror = IndexMirror(reg.layout_id)
    task = asyncio.create_task(follow(mirror, channels[1]))
    return session, ns, mirror, task, channels


def mirror_loads(mirror: IndexMirror, engine: str) -> list[float]:
    return [m.load for m in mirror.resolve("", H) or [] if m.engine_id == engine]


async def resolve_loads(server: RunningServer, ns: pb.Namespace, engine: str) -> list[float]:
    async with grpc.aio.insecure_channel(server.address) as ch:
        answer = await broker_pb2_grpc.KVBrokerStub(ch).Resolve(
            pb.ResolveRequest(namespace=ns, block_hashes=H)
        )
    return [m.load for m in answer.matches if m.engine_id == engine]


async def check_load_reaches_readers(writer: RunningServer, reader: RunningServer) -> None:
    engine = f"P-{secrets.token_hex(3)}"
    session, ns, mirror, task, channels = await holder_and_mirror(writer, reader, engine)
    try:
        await until(lambda: mirror_loads(mirror, engine) == [0.0], message="mirror never synced")
        for load in (6.0, 0.0, 3.0):
            await heartbeat(session, load)

            async def resolved(load: float = load) -> bool:
                return await resolve_loads(reader, ns, engine) == [load]

            await until(resolved, timeout=5.0, message=f"Resolve never named load {load}")
            await until(lambda load=load: mirror_loads(mirror, engine) == [load], timeout=5.0)  # type: ignore[misc]
            await asyncio.sleep(observed.LOAD_REPUBLISH_S)  # the next one is not held back
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await session.close()
        for ch in channels:
            await ch.close()


async def test_load_reaches_resolve_and_mirror(broker: RunningServer) -> None:
    """Both backends (the fixture runs in-memory and on a real redis-server)."""
    await check_load_reaches_readers(broker, broker)


async def test_load_reaches_another_replica(redis_server: RedisServer) -> None:
    """The engine heartbeats to one replica; Resolve and a mirror on the other see its load."""
    state = {"state": redis_server.url, "state_prefix": f"t{secrets.token_hex(4)}"}
    async with (
        running_broker(**state, expiry_interval_ms=20) as a,
        running_broker(**state, expiry_interval_ms=20) as b,
    ):
        await check_load_reaches_readers(a, b)
