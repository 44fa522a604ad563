"""What operators see of a fleet of `kvbroker serve --state redis://...` replicas over one real
redis-server (the Watch also over a real 3-primary Redis Cluster), on whichever replica they ask.

Watch: a Watch on replica a shows the events of leases and engines made
through replica b, each once and in each lease's order; cut a's connection to
Redis (CLIENT KILL) and the events b makes meanwhile still arrive, once a reads
on. Stats and metrics: releases, operator revokes, declines and expiries made
through either replica add up in the Stats of both; each replica's
Prometheus series count its own part, and its `kvbroker_fleet_*` gauges show
the fleet's totals.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import grpc
import pytest
import redis
from process_engine_client import engine_info
from process_harness import replica

from kvbroker.clients import errors
from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.clients.engine_session import EngineSession
from kvbroker.common.causes import Cause
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.ports import free_port
from testkit.redis_cluster import RedisCluster
from testkit.redis_server import RedisServer
from testkit.waiting import until

pytestmark = pytest.mark.timeout(120)

GPU = pb.TIER_GPU
BLOCKS = [401, 402, 403]
# What arrives in milliseconds on a quiet machine may take seconds on a loaded 2-core CI host (a
# Redis Cluster of six servers shares it with vLLM engines); a lost event would never arrive.
LOADED_S = 20.0


class WatchLog:
    """A Watch stream on one replica, read into a list as it comes."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        self.call = stub.Watch(pb.WatchRequest(lease_events=True, engine_events=True))
        self.events: list[pb.WatchEvent] = []
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for event in self.call:
            self.events.append(event)

    def of_lease(self, lease_id: str) -> list[str]:
        return [e.kind for e in self.events if e.lease.lease_id == lease_id]

    def of_engine(self, engine_id: str) -> list[str]:
        return [e.kind for e in self.events if e.engine_id == engine_id and not e.HasField("lease")]

    async def close(self) -> None:
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self._task


@contextlib.asynccontextmanager
async def watching(address: str) -> AsyncIterator[WatchLog]:
    async with grpc.aio.insecure_channel(address) as channel:
        log = WatchLog(channel)
        try:
            yield log
        finally:
            await log.close()


async def started(address: str, engine_id: str) -> EngineSession:
    session = EngineSession(address, engine_info(engine_id), ttl_ms=5_000)
    await session.start(wait_connected_s=10.0)
    return session


async def until_fleet_appends(log: WatchLog, holder: EngineSession, address: str) -> None:
    """The other replicas append for a new Watch once they hear of it (milliseconds): hold through
    the holder's replica until a hold shows on the Watch, and give the probes back."""
    probes: list[str] = []

    async def seen() -> bool:
        held = await holder.hold((holder.layout_id, ""), GPU, BLOCKS[:1], [1], 60_000)
        probes.append(held.lease_id)
        await asyncio.sleep(0.05)
        return any(log.of_lease(lease_id) for lease_id in probes)

    await until(seen, timeout=10.0, interval=0.05, message="the other replica never appended for the Watch")
    async with AsyncBrokerClient(address) as operator:
        for lease_id in probes:
            await operator.revoke(lease_id=lease_id, reason="probe")


async def test_a_watch_on_one_replica_shows_what_the_other_does(
    tmp_path: Path, shared_store: RedisServer | RedisCluster
) -> None:
    store = shared_store
    a, b = replica(tmp_path, store, "a").start(), replica(tmp_path, store, "b").start()
    p = d = None
    try:
        p, d = await started(b.address, "P"), await started(b.address, "D")  # both engines on b
        p.announce_stored((p.layout_id, ""), GPU, BLOCKS)
        await p.applied()
        async with watching(a.address) as log:
            await until_fleet_appends(log, p, b.address)

            # A lease's whole life through b, seen on a: each event once, in the lease's order.
            held = await p.hold((p.layout_id, ""), GPU, BLOCKS, [1, 2, 3], 60_000, reader_engine_id="D")
            acquired = await d.acquire(held.lease_id)
            await d.release(held.lease_id, acquired.lease.epoch)
            await until(
                lambda: len(log.of_lease(held.lease_id)) >= 3, timeout=LOADED_S, message=f"{log.events}"
            )
            assert log.of_lease(held.lease_id) == ["lease_held", "lease_active", "lease_released"]

            # An engine that comes and goes through b.
            e = await started(b.address, "E")
            await e.close()
            await until(
                lambda: "engine_gone" in log.of_engine("E"), timeout=LOADED_S, message=f"{log.events}"
            )
            # A replica the loaded host starved may judge E silent for a moment: an
            # `engine_exactness` event, if any, comes between the two.
            seen = [kind for kind in log.of_engine("E") if kind != "engine_exactness"]
            assert seen == ["engine_registered", "engine_gone"], f"{log.events}"

            # a's connection to Redis is cut; what b does before a is back still reaches the Watch.
            killed = cut_watch_readers(store)
            assert killed == 1  # a's reader only: b has no watchers, so it reads nothing
            held2 = await p.hold((p.layout_id, ""), GPU, BLOCKS, [1, 2, 3], 60_000, reader_engine_id="D")
            acquired2 = await d.acquire(held2.lease_id)
            await d.release(held2.lease_id, acquired2.lease.epoch)
            await until(
                lambda: len(log.of_lease(held2.lease_id)) >= 3, timeout=LOADED_S, message=f"{log.events}"
            )
            assert log.of_lease(held2.lease_id) == ["lease_held", "lease_active", "lease_released"]
            assert "watch stream lost" in a.log_path.read_text()  # it really was cut off
            assert all(e.kind != "events_missed" for e in log.events)
            assert not log.call.done()  # the Watch itself never broke
    finally:
        for session in (p, d):
            if session is not None:
                await session.close()
        a.stop()
        b.stop()


def cut_watch_readers(store: RedisServer | RedisCluster) -> int:
    """CLIENT KILL every replica's watch-stream reader (on every node), as a network cut would."""
    clients = [n.client() for n in store.nodes] if isinstance(store, RedisCluster) else [store_client(store)]
    killed = 0
    for client in clients:
        readers = [c for c in client.client_list() if c.get("name", "").startswith("kvbroker-watch-")]
        killed += sum(int(client.client_kill_filter(_id=c["id"])) for c in readers)
        client.close()
    return killed


def store_client(store: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(store.url)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def test_stats_and_metrics_count_the_whole_fleet(tmp_path: Path, store: RedisServer) -> None:
    ports = free_port(), free_port()
    a = replica(tmp_path, store, "a", ports[0]).start()
    b = replica(tmp_path, store, "b", ports[1]).start()
    p = d = None
    try:
        p, d = await started(a.address, "P"), await started(b.address, "D")  # holder on a, reader on b
        ns = (p.layout_id, "")
        # Released through b (the reader's replica).
        held = await p.hold(ns, GPU, BLOCKS, [1, 2, 3], 60_000, reader_engine_id="D")
        acquired = await d.acquire(held.lease_id)
        await d.release(held.lease_id, acquired.lease.epoch)
        # Revoked by an operator through a, declined through b, expired (swept by either).
        spare = await p.hold(ns, GPU, BLOCKS, [1, 2, 3], 60_000)
        async with AsyncBrokerClient(a.address) as operator:
            await operator.revoke(lease_id=spare.lease_id, reason="test")
        await p.hold(ns, GPU, BLOCKS, [1, 2, 3], 60_000, reader_engine_id="D", request_id="r-declined")
        await d.decline("P", "r-declined")
        await p.hold(ns, GPU, BLOCKS, [1, 2, 3], 100)

        want = {"operator": 1, "declined": 1, "ttl_expired": 1}

        async def fleet_counted(address: str) -> bool:
            async with AsyncBrokerClient(address) as client:
                stats = await client.stats()
            causes = {k: v for k, v in stats.revocations_by_cause.items() if v}
            return causes == want and stats.leases_by_state["released"] == 1

        for address in (a.address, b.address):
            await until(partial(fleet_counted, address), timeout=10.0, message=f"{address}: not the fleet's")
        async with AsyncBrokerClient(b.address) as client:
            stats = await client.stats()
        assert stats.leases_by_state["revoked"] == 3

        # Each replica's own series count what it did; the fleet gauges show the sum on both.
        seen = [scrape(port) for port in ports]
        for cause, n in want.items():
            label = f'{{cause="{cause}"}}'
            assert [m[f"kvbroker_fleet_revocations{label}"] for m in seen] == [n, n]
            assert sum(m[f"kvbroker_revocations_total{label}"] for m in seen) == n
        assert [m['kvbroker_revocations_total{cause="operator"}'] for m in seen] == [1, 0]  # a revoked
        assert [m['kvbroker_revocations_total{cause="declined"}'] for m in seen] == [0, 1]  # b declined
        assert [m['kvbroker_fleet_leases_ended{state="released"}'] for m in seen] == [1, 1]
        assert [m['kvbroker_leases_ended_total{state="released"}'] for m in seen] == [0, 1]
    finally:
        for session in (p, d):
            if session is not None:
                await session.close()
        a.stop()
        b.stop()


async def test_a_drain_through_one_replica_marks_the_engine_whose_stream_is_on_the_other(
    tmp_path: Path, store: RedisServer
) -> None:
    a, b = replica(tmp_path, store, "a").start(), replica(tmp_path, store, "b").start()
    drained: list[pb.DrainCommand] = []
    p = EngineSession(a.address, engine_info("P"), ttl_ms=5_000, on_drain=drained.append)
    try:
        await p.start(wait_connected_s=10.0)
        async with AsyncBrokerClient(b.address) as operator:
            await operator.drain(engine_id="P", reason="upgrade")
        await until(lambda: drained, message="P never got the drain command")
        assert drained[0].reason == "upgrade"

        # P's own replica (a) knows it drains: it refuses P's new holds ...
        with pytest.raises(errors.FailedPrecondition) as refused:
            await p.hold((p.layout_id, ""), GPU, BLOCKS, [1, 2, 3], 60_000)
        assert refused.value.cause == Cause.DRAINING

        # ... and its record in the store says so to every replica, and stays so after a's pushes.
        async def draining_everywhere() -> bool:
            for address in (a.address, b.address):
                async with AsyncBrokerClient(address) as client:
                    listed = await client.list_engines()
                if [(e.engine_id, e.draining) for e in listed.engines] != [("P", True)]:
                    return False
            return True

        await until(
            draining_everywhere, timeout=LOADED_S, message="the draining flag did not reach the store"
        )
        await asyncio.sleep(0.6)  # two of a's deadline pushes (every 0.25 s) later, still draining
        assert await draining_everywhere()
    finally:
        await p.close()
        a.stop()
        b.stop()


async def test_a_decline_through_one_replica_before_its_hold_refuses_the_hold_on_the_other(
    tmp_path: Path, store: RedisServer
) -> None:
    a, b = replica(tmp_path, store, "a").start(), replica(tmp_path, store, "b").start()
    p, d = await started(a.address, "P"), await started(b.address, "D")  # holder on a, reader on b
    ns = (p.layout_id, "")
    try:
        # D declines P's hold of r1 through b before P holds it through a.
        answer = await d.decline("P", "r1", "D has it cached")
        assert not answer.HasField("lease")  # nothing to end yet: remembered

        async def hold_refused() -> bool:
            try:
                await p.hold(ns, GPU, BLOCKS, [1, 2, 3], 60_000, reader_engine_id="D", request_id="r1")
            except errors.FailedPrecondition as err:
                assert err.cause == "declined", err
                return True
            return False  # came before a heard of the decline: a ends it as declined when it does

        await until(hold_refused, timeout=LOADED_S, message="a never heard of b's early decline")

        # Every hold of r1 made through a ended (refused, or ended as declined): none is left.
        async def none_left() -> bool:
            async with AsyncBrokerClient(b.address) as operator:
                return not (await operator.list_leases(engine_id="P")).leases

        await until(none_left, message="a hold of the declined request is still live")
        # An early decline is used once: the next hold of r1 is taken (as with one broker).
        again = await p.hold(ns, GPU, BLOCKS, [1, 2, 3], 60_000, reader_engine_id="D", request_id="r1")
        assert again.state == pb.LEASE_HELD
    finally:
        await asyncio.gather(p.close(), d.close(), return_exceptions=True)
        a.stop()
        b.stop()
