"""Two `kvbroker serve --state redis://...` replicas over one real redis-server (and, for the
failover and mirror tests, over a real 3-primary Redis Cluster too).

Engine sessions (Python clients, each given both replicas' addresses, in
different orders so that the holder and the reader sit on different replicas):
resolve names holders on the other replica, a revocation made through one
replica reaches the engine on the other, and kill -9 of a replica moves its
sessions to the other within 2 s, resuming them: same session, leases kept, a
read released after the failover still commits. A Mirror stream on one
replica follows index changes made through the other. Redis stopped: lease
calls are UNAVAILABLE (state_unavailable); Redis back empty: the replicas end
the sessions the store lost, the engines register again and re-announce, and
the fleet's index is whole again. Kill -9 under load from three holder/reader
pairs: every session resumes within 2 s, no acquired lease ends under its
reader, none leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import grpc
import pytest
import redis
from process_engine_client import engine_info
from process_harness import crossed_sessions, replica
from test_process_liveness import Timeline

from kvbroker.clients import errors
from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.clients.clock import Backoff
from kvbroker.clients.engine_session import EngineSession
from kvbroker.clients.mirror import IndexMirror, follow
from kvbroker.v1 import broker_pb2 as pb
from testkit.redis_cluster import RedisCluster
from testkit.redis_server import RedisServer
from testkit.waiting import until

pytestmark = pytest.mark.timeout(120)

GPU = pb.TIER_GPU
BLOCKS = [301, 302, 303, 304, 305]
FAILOVER_S = 2.0


async def test_kill9_replica_moves_sessions_and_keeps_leases(
    tmp_path: Path, shared_store: RedisServer | RedisCluster
) -> None:
    a, b = replica(tmp_path, shared_store, "a").start(), replica(tmp_path, shared_store, "b").start()
    p, d, p_events, d_events = crossed_sessions(a.address, b.address, 5_000)
    try:
        await p.start(wait_connected_s=10.0)
        await d.start(wait_connected_s=10.0)
        p.announce_stored((p.layout_id, ""), GPU, BLOCKS)
        await p.applied()
        held = await p.hold(
            (p.layout_id, ""), GPU, BLOCKS, [1, 2, 3, 4, 5], 60_000, reader_engine_id="D", request_id="r1"
        )
        spare = await p.hold((p.layout_id, ""), GPU, BLOCKS[:2], [1, 2], 60_000, request_id="r2")

        # D's replica (b) names P (whose stream is on a) and P's hold.
        found = await d.resolve((d.layout_id, ""), BLOCKS)
        assert [(m.engine_id, m.matched_blocks) for m in found.matches] == [("P", 5)]
        assert found.matches[0].hold_lease_id == held.lease_id
        acquired = await d.acquire(held.lease_id)
        assert acquired.lease.state == pb.LEASE_ACTIVE and acquired.holder.engine_id == "P"

        # An operator's revoke through b reaches P on a.
        async with AsyncBrokerClient(b.address) as operator:
            await operator.revoke(lease_id=spare.lease_id, reason="test")
        _, ended = await p_events.wait_for("lease_ended", timeout=5.0)
        assert ended.lease.lease_id == spare.lease_id

        # A unary call from P's host acts as P on b too (the owner shares its sessions' hosts).
        async def unary_hold() -> bool:
            with contextlib.suppress(errors.PermissionDenied):
                async with AsyncBrokerClient(b.address) as client:
                    request = dict(namespace=pb.Namespace(layout_id=p.layout_id), tier=GPU, block_ids=[1])
                    held = await client.hold(holder_engine_id="P", block_hashes=BLOCKS[:1], **request)
                    await client.revoke(lease_id=held.lease.lease_id, reason="test")
                    return True
            return False

        await until(unary_hold, timeout=5.0, interval=0.1)

        # kill -9 the holder's replica: P resumes on b within FAILOVER_S, its session kept.
        session_before = p.registered.session_id
        killed = time.monotonic()
        a.kill9()
        moved_at, registered = await p_events.wait_for("connected", count=2, timeout=10.0)
        moved_s = moved_at - killed
        print(f"\nsession moved to the other replica {moved_s * 1000:.0f} ms after kill -9")
        assert moved_s < FAILOVER_S
        assert registered.resumed and registered.session_id == session_before
        assert d.connected  # D was on b all along

        # The lease lived through it: D's release commits the read, and P hears it ended.
        released = await d.release(held.lease_id, acquired.lease.epoch)
        assert released.state == pb.LEASE_RELEASED
        await until(
            lambda: any(
                k == "lease_ended" and m.lease.lease_id == held.lease_id for k, _, m in p_events.events
            )
        )
        # P's blocks are still indexed (resumed, not re-registered from scratch), and nothing leaked.
        found = await d.resolve((d.layout_id, ""), BLOCKS)
        assert [(m.engine_id, m.matched_blocks) for m in found.matches] == [("P", 5)]
        async with AsyncBrokerClient(b.address) as operator:
            live = await operator.list_leases()
            assert [lease.lease_id for lease in live.leases] == []
            stats = await operator.stats()
            assert stats.engines == 2
        assert not d_events.events or all(kind != "revoked" for kind, _, _ in d_events.events)
    finally:
        await asyncio.gather(p.close(), d.close(), return_exceptions=True)
        a.stop()
        b.stop()


async def test_a_mirror_on_one_replica_follows_engines_on_the_other(
    tmp_path: Path, shared_store: RedisServer | RedisCluster
) -> None:
    a, b = replica(tmp_path, shared_store, "a").start(), replica(tmp_path, shared_store, "b").start()
    p = EngineSession(a.address, engine_info("P"), ttl_ms=5_000)
    try:
        await p.start(wait_connected_s=10.0)
        p.announce_stored((p.layout_id, ""), GPU, BLOCKS[:2])
        await p.applied()
        mirror = IndexMirror(p.layout_id)
        async with grpc.aio.insecure_channel(b.address) as channel:
            following = asyncio.create_task(follow(mirror, channel))
            await until(lambda: mirror.synced)
            snapshot = mirror.resolve("", BLOCKS)
            assert snapshot is not None and [(m.engine_id, m.matched_blocks) for m in snapshot] == [("P", 2)]
            # Changes made through a after the snapshot reach b's mirror.
            p.announce_stored((p.layout_id, ""), GPU, BLOCKS[2:])
            await p.applied()

            def whole() -> bool:
                found = mirror.resolve("", BLOCKS)
                return found is not None and [(m.engine_id, m.matched_blocks) for m in found] == [("P", 5)]

            await until(whole)
            p.announce_removed((p.layout_id, ""), GPU, BLOCKS[1:2])
            await p.applied()
            await until(lambda: [m.matched_blocks for m in mirror.resolve("", BLOCKS) or []] == [1])
            following.cancel()
    finally:
        await p.close()
        a.stop()
        b.stop()


async def test_store_restart_refuses_leases_then_the_fleet_rebuilds_its_index(
    tmp_path: Path, store: RedisServer
) -> None:
    a, b = replica(tmp_path, store, "a").start(), replica(tmp_path, store, "b").start()
    fast = Backoff(initial_s=0.05, max_s=0.5)
    p = EngineSession(f"{a.address},{b.address}", engine_info("P"), ttl_ms=5_000, backoff=fast)
    d = EngineSession(f"{b.address},{a.address}", engine_info("D"), ttl_ms=5_000, backoff=fast)
    try:
        await p.start(wait_connected_s=10.0)
        await d.start(wait_connected_s=10.0)
        p.announce_stored((p.layout_id, ""), GPU, BLOCKS)
        await p.applied()
        store.stop()
        with pytest.raises(errors.Unavailable) as refused:
            await p.hold((p.layout_id, ""), GPU, BLOCKS, [1, 2, 3, 4, 5], 60_000, reader_engine_id="D")
        assert refused.value.cause == "state_unavailable"
        store.start()  # the same port, empty: every session, lease and block is gone from it

        async def rebuilt() -> bool:
            # Both engines registered anew (each is told when its replica next finds its session
            # gone from the store: D may hear it after P's blocks are back), and P's blocks indexed.
            if p.registrations < 2 or d.registrations < 2:
                return False
            with contextlib.suppress(errors.BrokerError):
                found = await d.resolve((d.layout_id, ""), BLOCKS)
                return [(m.engine_id, m.matched_blocks) for m in found.matches] == [("P", 5)]
            return False

        await until(rebuilt, timeout=15.0, interval=0.1)
        for engine in (p, d):
            assert engine.registered is not None and not engine.registered.resumed
        held = await p.hold((p.layout_id, ""), GPU, BLOCKS, [1, 2, 3, 4, 5], 60_000, reader_engine_id="D")
        acquired = await d.acquire(held.lease_id)
        assert (await d.release(held.lease_id, acquired.lease.epoch)).state == pb.LEASE_RELEASED
    finally:
        await asyncio.gather(p.close(), d.close(), return_exceptions=True)
        a.stop()
        b.stop()


async def test_kill9_during_load_from_several_sessions(
    tmp_path: Path, shared_store: RedisServer | RedisCluster
) -> None:
    """Three holder/reader pairs run lease cycles through replica a; kill -9 a mid-load."""
    a, b = replica(tmp_path, shared_store, "a").start(), replica(tmp_path, shared_store, "b").start()
    fast = Backoff(initial_s=0.05, max_s=0.5)
    pairs = []
    for i in range(3):
        events = Timeline()
        holder = EngineSession(
            f"{a.address},{b.address}", engine_info(f"H{i}"), ttl_ms=5_000, backoff=fast, **events.callbacks()
        )
        reader = EngineSession(
            f"{a.address},{b.address}",
            engine_info(f"R{i}"),
            ttl_ms=5_000,
            backoff=fast,
            **Timeline().callbacks(),
        )
        pairs.append((holder, reader, events))
    sessions = [s for h, r, _ in pairs for s in (h, r)]
    outcome = {"committed": 0, "refused_hold": 0, "retried_release": 0}
    lost: list[str] = []
    unsure_holds: list[tuple[EngineSession, str, str]] = []
    unsure_acquires: list[tuple[EngineSession, str]] = []
    stop = asyncio.Event()

    async def cycles(holder: EngineSession, reader: EngineSession) -> None:
        ns = (holder.layout_id, "")
        i = 0
        while not stop.is_set():
            i += 1
            request_id = f"{holder.engine_id}-{i}"
            try:
                held = await holder.hold(
                    ns,
                    GPU,
                    BLOCKS,
                    [1, 2, 3, 4, 5],
                    30_000,
                    reader_engine_id=reader.engine_id,
                    request_id=request_id,
                )
            except errors.Unavailable:
                unsure_holds.append((reader, holder.engine_id, request_id))  # the hold may exist: decline it
                outcome["refused_hold"] += 1
                await asyncio.sleep(0.02)
                continue
            try:
                acquired = await reader.acquire(held.lease_id)
            except errors.Unavailable:
                # The acquire may have taken effect before its answer was lost: the reader gives
                # the lease back (release with no epoch), or declines the hold if it never did.
                unsure_acquires.append((reader, held.lease_id))
                unsure_holds.append((reader, holder.engine_id, request_id))
                await asyncio.sleep(0.02)
                continue
            for attempt in range(50):
                try:
                    await reader.release(held.lease_id, acquired.lease.epoch)
                    outcome["committed"] += 1
                    break
                except errors.Unavailable:
                    outcome["retried_release"] += 1  # lost with the replica: ask again once moved
                    await asyncio.sleep(0.05)
                except errors.FailedPrecondition as err:
                    if err.cause == "released" and attempt:
                        outcome["committed"] += 1  # the first try had committed before the answer was lost
                    else:
                        lost.append(f"{held.lease_id}: {err.cause} {err}")
                    break

    try:
        await asyncio.gather(*(s.start(wait_connected_s=10.0) for s in sessions))
        for holder, _, _ in pairs:
            holder.announce_stored((holder.layout_id, ""), GPU, BLOCKS)
            await holder.applied()
        load = [asyncio.create_task(cycles(h, r)) for h, r, _ in pairs]
        await asyncio.sleep(1.0)
        before = outcome["committed"]
        killed = time.monotonic()
        a.kill9()
        moved = [
            t for t, _ in await asyncio.gather(*(ev.wait_for("connected", count=2) for _, _, ev in pairs))
        ]
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*load)
        worst = max(moved) - killed
        print(
            f"\n{outcome}; {len(unsure_acquires)} acquires unsure; holders moved within {worst * 1000:.0f} ms"
        )
        assert worst < FAILOVER_S
        assert all(s.registered is not None and s.registered.resumed for s in sessions)
        assert before > 0 and outcome["committed"] > before  # load went on after the failover
        assert lost == []  # no acquired lease ended under its reader
        for reader, lease_id in unsure_acquires:
            with contextlib.suppress(errors.BrokerError):
                await reader.release(lease_id, 0)
        for reader, holder_id, request_id in unsure_holds:
            with contextlib.suppress(errors.BrokerError):
                await reader.decline(holder_id, request_id, "the hold's answer was lost in a failover")
        async with AsyncBrokerClient(b.address) as operator:
            assert [lease.lease_id for lease in (await operator.list_leases()).leases] == []  # none leaked
    finally:
        stop.set()
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
        a.stop()
        b.stop()


@pytest.mark.parametrize("shared_store", ["redis"], indirect=True)
async def test_an_engine_restarted_on_one_replica_is_announced_to_readers_on_the_other(
    tmp_path: Path, shared_store: RedisServer
) -> None:
    """Reader D's session is on replica a, holder P's on b. P restarts (its session ends, a new
    one of the engine id registers): D hears the new generation on its
    own stream, unasked, through the fleet's channel: the generation ListEngines names."""
    a, b = replica(tmp_path, shared_store, "a").start(), replica(tmp_path, shared_store, "b").start()
    heard: list[pb.EngineGeneration] = []
    d = EngineSession(a.address, engine_info("D"), ttl_ms=5_000, on_engine_generation=heard.append)
    p = EngineSession(b.address, engine_info("P"), ttl_ms=5_000)
    restarted = EngineSession(b.address, engine_info("P"), ttl_ms=5_000)
    try:
        await d.start(wait_connected_s=10.0)
        await p.start(wait_connected_s=10.0)
        await until(lambda: [g.engine_id for g in heard] == ["P"], message=f"D heard {heard}")
        await p.close()
        await restarted.start(wait_connected_s=10.0)
        await until(lambda: len(heard) == 2, message=f"D heard {heard}")
        listed = {e.engine_id: e.generation for e in (await d.client.list_engines()).engines}
        assert heard[1].engine_id == "P" and heard[1].generation == listed["P"] > heard[0].generation
    finally:
        for session in (restarted, p, d):
            await session.close()
        a.stop()
        b.stop()


@pytest.mark.parametrize("shared_store", ["redis"], indirect=True)
async def test_a_generation_published_while_a_replicas_channel_is_down_still_reaches_its_readers(
    tmp_path: Path, shared_store: RedisServer
) -> None:
    """As above, but replica a's subscription to the fleet's channel is cut (CLIENT KILL TYPE pubsub,
    as a network cut would) just before P registers anew on b: the notice b publishes is lost to a,
    which resubscribes only after half a second. Once subscribed again, a reads the engines' records
    and tells D the generation it missed, unasked, before any lease names it."""
    a, b = replica(tmp_path, shared_store, "a").start(), replica(tmp_path, shared_store, "b").start()
    heard: list[pb.EngineGeneration] = []
    d = EngineSession(a.address, engine_info("D"), ttl_ms=5_000, on_engine_generation=heard.append)
    p = EngineSession(b.address, engine_info("P"), ttl_ms=5_000)
    restarted = EngineSession(b.address, engine_info("P"), ttl_ms=5_000)
    store = redis.Redis.from_url(shared_store.url)
    try:
        await d.start(wait_connected_s=10.0)
        await p.start(wait_connected_s=10.0)
        await until(lambda: [g.engine_id for g in heard] == ["P"], message=f"D heard {heard}")
        await p.close()
        assert int(store.execute_command("CLIENT", "KILL", "TYPE", "pubsub")) >= 2  # both replicas'
        await restarted.start(wait_connected_s=10.0)
        await until(lambda: len(heard) == 2, timeout=10.0, message=f"D heard {heard}")
        listed = {e.engine_id: e.generation for e in (await d.client.list_engines()).engines}
        assert heard[1].engine_id == "P" and heard[1].generation == listed["P"] > heard[0].generation
        await asyncio.sleep(1.0)
        assert len(heard) == 2, f"told once: {heard}"
    finally:
        store.close()
        for session in (restarted, p, d):
            await session.close()
        a.stop()
        b.stop()
