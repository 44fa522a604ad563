"""The P/D proxy's background Decline when the replica it talks to is frozen (SIGSTOP): the client
tries the other replica within the Decline's deadline, so P frees its hold at once instead of at
the hold's TTL. A real process tree: two `kvbroker serve --state redis://...` replicas over a real
redis-server, P and D engine sessions on the replica that stays up, and the proxy's application
(`build_app`, its own AsyncBrokerClient from `--broker a,b`) declining P's hold the way it does
after a failed decode.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_harness import SLACK_S, freeze, thaw
from process_harness import replica
from test_process_liveness import Timeline

from kvbroker.clients.engine_session import EngineSession
from kvbroker.clients.proxy.config import ProxyConfig
from kvbroker.clients.proxy.declines import DECLINE_TIMEOUT_S
from kvbroker.clients.proxy.server import STATE_KEY, build_app
from kvbroker.v1 import broker_pb2 as pb
from testkit import builders
from testkit.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

GPU = pb.TIER_GPU
BLOCKS = [611, 612, 613]
HOLD_TTL_MS = 60_000  # far beyond the test: only the Decline can end the hold in time


async def test_a_frozen_replica_does_not_keep_the_proxys_decline_from_freeing_the_hold(
    tmp_path: Path, store: RedisServer
) -> None:
    a, b = replica(tmp_path, store, "a").start(), replica(tmp_path, store, "b").start()
    p_events = Timeline()
    p = EngineSession(b.address, builders.engine_info("P", ranks=1), ttl_ms=5_000, **p_events.callbacks())
    d = EngineSession(b.address, builders.engine_info("D", ranks=1), ttl_ms=5_000)
    app = build_app(ProxyConfig(broker=f"{a.address},{b.address}"))
    state = app[STATE_KEY]
    stopped = False
    try:
        await p.start(wait_connected_s=10.0)
        await d.start(wait_connected_s=10.0)
        p.announce_stored((p.layout_id, ""), GPU, BLOCKS)
        await p.applied()
        held = await p.hold(
            (p.layout_id, ""), GPU, BLOCKS, [1, 2, 3], HOLD_TTL_MS, reader_engine_id="D", request_id="req-1"
        )
        assert state.broker is not None and state.broker.endpoints.current == a.address

        at = freeze(a.pid)
        stopped = True
        # What the proxy does when the decode engine rejected the request (in the background).
        params = {"kvbroker": {"holder_engine_id": "P", "hold_request_id": "req-1"}}
        state.forwarder.declines.decline(params, "the decode engine rejected the request (test)")
        ended_at, ended = await p_events.wait_for("lease_ended", timeout=DECLINE_TIMEOUT_S + 10.0)
        took = ended_at - at
        print(
            f"\nfrozen replica: P's hold was declined through the other replica {took * 1000:.0f} ms "
            f"after the proxy sent it (Decline deadline {DECLINE_TIMEOUT_S:g} s, two replicas)"
        )
        assert ended.lease.lease_id == held.lease_id and ended.lease.state == pb.LEASE_REVOKED
        assert took < DECLINE_TIMEOUT_S + SLACK_S + 2.0  # generous: a loaded machine's scheduling
        assert state.broker.endpoints.current == b.address  # later calls go to the live replica
        leases = (await state.broker.list_leases(include_ended=True)).leases
        mine = [lease for lease in leases if lease.lease_id == held.lease_id]
        assert [lease.state for lease in mine] == [pb.LEASE_REVOKED], mine
    finally:
        if stopped:
            thaw(a.pid)
        await state.http.close()
        if state.broker is not None:
            await state.broker.close()
        await p.close()
        await d.close()
        a.stop()
        b.stop()
