"""A hung store must not freeze the replicas: two `kvbroker serve --state redis://...` replicas
over a real redis-server that is paused (SIGSTOP: its connections stay open, nothing answers) for
1 s, 5 s and three session TTLs, with live engine sessions (each given both replicas) and router
callers (the async and the blocking client, 1 s deadline) running through the pause.

Each case asserts: every caller got an answer within its deadline (UNAVAILABLE is one: the
replica fails fast once it found the store away), both engines' sessions lived through the pause
without a reconnect (heartbeats are answered from what the replica knows), the reader's lease
taken before the pause still commits after it (0 leases lost, no revocation: 0 stale reads),
and the fleet grants again once the store is back (a new hold and its read commit). Index
changes the engine announced during the pause (blocks removed, blocks stored) are in the shared
index once the store is back: the removed ones name no holder, the stored ones name the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path

import pytest
from fault_harness import Callers, freeze, thaw
from process_harness import crossed_sessions, hold_once, replica, start_with_a_read

from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.v1 import broker_pb2 as pb
from testkit.redis_server import RedisServer
from testkit.waiting import until

pytestmark = pytest.mark.timeout(120)

GPU = pb.TIER_GPU
BLOCKS = [501, 502, 503]
DROPPED, STORED = [511, 512], [521, 522]  # announced before the pause / during it
TTL_MS = 3_000  # the engines move off a replica silent for a quarter of it (0.75 s)


@pytest.mark.parametrize("pause_s", [1.0, 5.0, 3 * TTL_MS / 1000], ids=["1s", "5s", "3xTTL"])
async def test_a_paused_store_costs_answers_not_sessions(
    tmp_path: Path, store: RedisServer, pause_s: float
) -> None:
    a, b = replica(tmp_path, store, "a").start(), replica(tmp_path, store, "b").start()
    p, d, p_events, d_events = crossed_sessions(a.address, b.address, TTL_MS)
    assert store.proc is not None
    paused = False
    try:
        held, acquired = await start_with_a_read(p, d, BLOCKS, also=DROPPED)
        ns = (p.layout_id, "")
        sessions = (p.registered.session_id, d.registered.session_id)

        async with Callers(f"{a.address},{b.address}", p.layout_id, BLOCKS) as callers:
            await asyncio.sleep(0.3)
            frozen_at = freeze(store.proc.pid)
            paused = True
            await asyncio.sleep(0.5)
            p.announce_removed(ns, GPU, DROPPED)
            p.announce_stored(ns, GPU, STORED)
            await p.applied()  # on the stream: the replica keeps them until the store answers
            await asyncio.sleep(max(0.0, pause_s - (time.monotonic() - frozen_at)))
            thaw(store.proc.pid)
            paused = False
            back_at = time.monotonic()
            await asyncio.sleep(1.5)

        during = [c for c in callers.calls if frozen_at + 0.5 < c.started < back_at]
        print(
            f"\nstore paused {pause_s:g} s: {len(callers.calls)} calls, slowest {max(c.took_s for c in callers.calls):.2f} s, "
            f"during the pause {sorted({c.outcome for c in during})}"
        )
        late = callers.late()
        assert not late, f"callers not answered within their deadline: {late}"
        # Fails fast, not late: UNAVAILABLE, or an answer a call got just before the store was marked
        # away; never a deadline passed.
        assert during and any(c.outcome == "UNAVAILABLE" for c in during), during
        assert all(c.outcome != "DEADLINE_EXCEEDED" for c in during), during
        assert min(callers.answered_after(back_at + 0.5).values()) > 0, callers.calls[-10:]
        # The sessions lived through it: no reconnect, same sessions.
        for events in (p_events, d_events):
            assert [k for k, _, _ in events.events if k in ("connected", "disconnected")] == ["connected"]
        assert (p.registered.session_id, d.registered.session_id) == sessions
        released = await d.release(held.lease_id, acquired.lease.epoch)
        assert released.state == pb.LEASE_RELEASED  # the read commits: no lease lost
        assert [m for k, _, m in p_events.events + d_events.events if k == "revoked"] == []
        # What the engine announced during the pause reached the shared index (read on the other replica).
        async with AsyncBrokerClient(b.address) as router:

            async def holders(hashes: list[int]) -> list[str]:
                request = pb.ResolveRequest(
                    namespace=pb.Namespace(layout_id=p.layout_id), block_hashes=hashes
                )
                return [m.engine_id for m in (await router.resolve(request, timeout=5.0)).matches]

            await until(lambda: _names(holders(STORED), ["P"]), timeout=10.0, interval=0.1)
            assert await holders(DROPPED) == []
        # Granting again.
        leases: list[pb.Lease] = []
        await until(lambda: hold_once(p, BLOCKS, leases), timeout=5.0, interval=0.1)
        again = leases[0]
        read = await d.acquire(again.lease_id)
        assert (await d.release(again.lease_id, read.lease.epoch)).state == pb.LEASE_RELEASED
    finally:
        if paused:
            thaw(store.proc.pid)
        await p.close()
        await d.close()
        a.stop()
        b.stop()


async def _names(found: Awaitable[list[str]], expected: list[str]) -> bool:
    return await found == expected
