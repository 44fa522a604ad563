"""The adapter's broker link over two broker replicas sharing a real redis-server: kill -9 of the
holder's replica keeps its session id (the scheduler keeps its holds for it), and the end of a hold
read through the other replica reaches the holder with the hold's request id (how a holder whose
Hold answer was lost in such a failover recognises its hold)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbroker.engine_adapter.broker_link import LeaseEndNotice, SessionBrokerLink
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.processes import SERVE, BrokerProcess
from testkit.redis_server import RedisServer
from testkit.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

H = [4301, 4302, 4303]


def test_a_resumed_session_keeps_its_id_and_hold_ends_name_their_request(
    tmp_path: Path, store: RedisServer
) -> None:
    args = ["--state", store.url, "--metrics-port", "0"]
    a = BrokerProcess(tmp_path, args, command=SERVE, log_name="a.log", priority=None).start()
    b = BrokerProcess(tmp_path, args, command=SERVE, log_name="b.log", priority=None).start()
    holder = SessionBrokerLink(
        f"{a.address},{b.address}", engine_info("P"), session_ttl_ms=5000, expected_ranks=1
    )
    reader = SessionBrokerLink(
        f"{b.address},{a.address}", engine_info("D"), session_ttl_ms=5000, expected_ranks=1
    )
    try:
        assert wait_for(lambda: holder.connected and reader.connected, 20.0), "sessions never registered"
        session_id = holder.session_id
        assert session_id
        ns = pb.Namespace(layout_id=holder.layout_id)
        holder.announce_stored(ns, H)
        held = holder.hold(ns, H, [1, 2, 3], ttl_ms=60_000, request_id="req-1", reader_engine_id="D").result(
            5
        )

        a.kill9()
        # The move is quick (the next replica at once): watch the registrations, not a gap in them.
        session = holder._session.session
        assert wait_for(lambda: holder.connected and session.registrations == 2, 5.0, 0.01), (
            "the holder's session did not move to b"
        )
        assert holder.session_id == session_id  # resumed: the scheduler keeps its holds

        acquired = reader.acquire(held.lease_id, 10_000).result(5)
        released = reader.release(held.lease_id, acquired.lease.epoch).result(5)
        assert released.state == pb.LEASE_RELEASED
        ends: list[LeaseEndNotice] = []
        assert wait_for(lambda: bool(ends.extend(holder.take_lease_ends()) or ends), 5.0)
        assert ends == [LeaseEndNotice(held.lease_id, "released", "req-1")]
        # The reader's notices (if any) name no request: the lease is not one it holds.
        assert all(notice.request_id == "" for notice in reader.take_lease_ends())
    finally:
        holder.close()
        reader.close()
        a.stop()
        b.stop()
