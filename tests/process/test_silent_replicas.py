"""Replicas that go silent without a reset: two `kvbroker serve --state redis://...` replicas over
a real redis-server, real engine sessions (EngineSession, each given both replicas' addresses),
and router callers (the async and the blocking client) running through the fault.

- SIGSTOP of the holder's replica (a frozen process: its kernel keeps every connection open);
- a blackholed link (testkit.tcp_proxy: the holder and the callers reach that replica through a
  proxy that stops forwarding without closing anything; the replica itself stays alive).

Each case asserts: the holder's session moved to the other replica and resumed (same session)
less than 2 s after the fault, its lease lived (the reader's release commits the read: 0 leases
lost, and no revocation reached anyone, so no read committed on a revoked lease: 0 stale reads),
the session outlives the replica's thaw or the link's end by more than a TTL (the silent replica
does not end it when it wakes or its own deadline passes), and every caller got an answer within
its deadline (UNAVAILABLE counts as one), with answers flowing again after the move.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from fault_harness import Callers, freeze, thaw
from process_harness import crossed_sessions, replica, start_with_a_read

from kvbroker.clients.aio import AsyncBrokerClient
from kvbroker.v1 import broker_pb2 as pb
from testkit.redis_server import RedisServer
from testkit.tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(120)

BLOCKS = [401, 402, 403]
TTL_MS = 2_000
LOST_S = 2.0  # service an engine may lose to a silent replica


async def _silent_replica_case(tmp_path: Path, store: RedisServer, fault: str) -> None:
    a, b = replica(tmp_path, store, "a").start(), replica(tmp_path, store, "b").start()
    proxy = TcpProxy(a.address).start()
    a_seen = proxy.address if fault == "blackhole" else a.address
    p, d, p_events, d_events = crossed_sessions(a_seen, b.address, TTL_MS)
    stopped = False
    try:
        held, acquired = await start_with_a_read(p, d, BLOCKS)
        assert acquired.lease.state == pb.LEASE_ACTIVE
        session_id = p.registered.session_id

        async with Callers(f"{a_seen},{b.address}", p.layout_id, BLOCKS) as callers:
            await asyncio.sleep(0.3)  # callers settle on the first replica
            if fault == "sigstop":
                at = freeze(a.pid)
                stopped = True
            else:
                at = time.monotonic()
                proxy.blackhole()
            moved_at, registered = await p_events.wait_for("connected", count=2, timeout=10.0)
            lost_s = moved_at - at
            print(
                f"\n{fault}: the holder's session resumed on the other replica {lost_s * 1000:.0f} ms after it"
            )
            assert lost_s < LOST_S
            assert registered.resumed and registered.session_id == session_id
            # Past the TTL with the replica still silent: nobody ended the session meanwhile.
            await asyncio.sleep(TTL_MS / 1000 * 1.5)
            if stopped:
                thaw(a.pid)
                stopped = False
            else:
                proxy.restore()
            # The silent replica wakes (or its own deadline for the session passes): it lets go.
            await asyncio.sleep(TTL_MS / 1000 * 1.5)

        late = callers.late()
        assert not late, f"callers not answered within their deadline: {late}"
        assert min(callers.answered_after(moved_at).values()) > 0, callers.calls[-10:]
        assert p.connected and p.registered.session_id == session_id
        assert [k for k, _, _ in p_events.events].count("connected") == 2  # no new session since
        released = await d.release(held.lease_id, acquired.lease.epoch)
        assert released.state == pb.LEASE_RELEASED  # the read commits: no lease lost
        revoked = [m for k, _, m in p_events.events + d_events.events if k == "revoked"]
        assert revoked == []  # no read committed on a revoked lease, none was revoked
        async with AsyncBrokerClient(b.address) as operator:
            assert [lease.lease_id for lease in (await operator.list_leases()).leases] == []
            found = await operator.resolve(
                pb.ResolveRequest(namespace=pb.Namespace(layout_id=p.layout_id), block_hashes=BLOCKS)
            )
            assert [(m.engine_id, m.matched_blocks) for m in found.matches] == [("P", 3)]
    finally:
        if stopped:
            thaw(a.pid)
        await p.close()
        await d.close()
        proxy.close()
        a.stop()
        b.stop()


async def test_frozen_replica_costs_no_session_and_no_lease(tmp_path: Path, store: RedisServer) -> None:
    await _silent_replica_case(tmp_path, store, "sigstop")


async def test_blackholed_link_costs_no_session_and_no_lease(tmp_path: Path, store: RedisServer) -> None:
    await _silent_replica_case(tmp_path, store, "blackhole")
