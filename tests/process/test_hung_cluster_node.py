"""A hung Redis Cluster node must not freeze the replicas: two `kvbroker serve --state
redis+cluster://...` replicas over a real 3-primary Cluster whose `{leases}` primary is paused
(SIGSTOP: its connections stay open, nothing answers) for 1.5 s (under the Cluster's 2 s node
timeout, so the Cluster itself does not fail the node), with live engine sessions and router
callers (1 s deadline) running through the pause.

Without a per-node fail-fast each call to that node (every lease call, and the expiry pass every
20 ms) would hold a replica's event loop 250 ms, and callers would see their deadlines pass.
Asserts: every caller answered within its deadline (UNAVAILABLE is an answer; never
DEADLINE_EXCEEDED), both sessions lived through the pause without a reconnect, the lease taken
before the pause commits after it (0 leases lost), and the fleet grants again once the node is back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_harness import Callers, freeze, thaw
from process_harness import crossed_sessions, hold_for_d, hold_once, replica, start_with_a_read

from kvbroker.clients import errors
from kvbroker.v1 import broker_pb2 as pb
from testkit.redis_cluster import RedisCluster, running_cluster
from testkit.redis_server import missing_reason
from testkit.waiting import until

pytestmark = pytest.mark.timeout(120)

BLOCKS = [701, 702, 703]
TTL_MS = 2_000
PAUSE_S = 1.5
LEASES_SLOT = 14949  # the slot of the `{leases}` tag


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    with running_cluster(tmp_path / "cluster") as setup:
        yield setup


async def test_a_paused_cluster_node_costs_answers_not_sessions(
    tmp_path: Path, cluster: RedisCluster
) -> None:
    a, b = replica(tmp_path, cluster, "a").start(), replica(tmp_path, cluster, "b").start()
    node = cluster.node_for_slot(LEASES_SLOT)
    assert node.proc is not None
    pid = node.proc.pid
    p, d, p_events, d_events = crossed_sessions(a.address, b.address, TTL_MS)
    paused = False
    try:
        held, acquired = await start_with_a_read(p, d, BLOCKS)
        sessions = (p.registered.session_id, d.registered.session_id)

        async with Callers(f"{a.address},{b.address}", p.layout_id, BLOCKS) as callers:
            await asyncio.sleep(0.3)
            frozen_at = freeze(pid)
            paused = True
            # Lease calls go to the paused node: answered (UNAVAILABLE), not left to their deadline.
            lease_calls: list[tuple[float, str]] = []
            while time.monotonic() - frozen_at < PAUSE_S:
                started = time.monotonic()
                try:
                    await asyncio.wait_for(hold_for_d(p, BLOCKS), timeout=5.0)
                    outcome = "ok"
                except errors.BrokerError as err:
                    outcome = err.code.name
                except TimeoutError:
                    outcome = "no answer in 5 s"
                lease_calls.append((time.monotonic() - started, outcome))
                await asyncio.sleep(0.05)
            thaw(pid)
            paused = False
            back_at = time.monotonic()
            await asyncio.sleep(1.5)

        print(
            f"\ncluster node paused {PAUSE_S:g} s: {len(callers.calls)} router calls, slowest "
            f"{max(c.took_s for c in callers.calls):.2f} s; {len(lease_calls)} holds during the pause, "
            f"slowest {max(t for t, _ in lease_calls):.2f} s, {sorted({o for _, o in lease_calls})}"
        )
        late = callers.late()
        assert not late, f"callers not answered within their deadline: {late}"
        assert all(c.outcome != "DEADLINE_EXCEEDED" for c in callers.calls), callers.calls
        assert any(o == "UNAVAILABLE" for _, o in lease_calls), lease_calls
        assert min(callers.answered_after(back_at + 0.5).values()) > 0, callers.calls[-10:]
        for events in (p_events, d_events):
            assert [k for k, _, _ in events.events if k in ("connected", "disconnected")] == ["connected"]
        assert (p.registered.session_id, d.registered.session_id) == sessions
        released = await d.release(held.lease_id, acquired.lease.epoch)
        assert released.state == pb.LEASE_RELEASED  # the read commits: no lease lost
        leases: list[pb.Lease] = []
        await until(lambda: hold_once(p, BLOCKS, leases), timeout=10.0, interval=0.1)
        read = await d.acquire(leases[0].lease_id)
        assert (await d.release(leases[0].lease_id, read.lease.epoch)).state == pb.LEASE_RELEASED
    finally:
        if paused:
            thaw(pid)
        await p.close()
        await d.close()
        a.stop()
        b.stop()
