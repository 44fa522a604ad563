"""An engine's load, from the adapter's broker link to a reader's, through a real broker process:
set_load goes out early (well before the next heartbeat), and the reader sees it both in its
index mirror's answer and in the broker's Resolve answer."""

from __future__ import annotations

import time
from pathlib import Path

from kvbroker.engine_adapter.broker_link import SessionBrokerLink
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.processes import SERVE, BrokerProcess
from testkit.waiting import wait_for

H = list(range(4200, 4208))
# Heartbeats every 20 s: a load seen within a few seconds came with an early report.
SESSION_TTL_MS = 60_000


def test_set_load_reaches_a_mirror_and_resolve_through_a_broker_process(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path, command=SERVE) as broker:
        holder = SessionBrokerLink(
            broker.address, engine_info("P"), session_ttl_ms=SESSION_TTL_MS, expected_ranks=1
        )
        reader = SessionBrokerLink(
            broker.address,
            engine_info("D"),
            session_ttl_ms=SESSION_TTL_MS,
            expected_ranks=1,
            index_mirror=True,
        )
        try:
            assert wait_for(lambda: holder.connected and reader.connected, 20.0), "sessions never registered"
            ns = pb.Namespace(layout_id=holder.layout_id)
            holder.announce_stored(ns, H)

            def mirror_load() -> list[float]:
                return [m.load for m in reader.mirror_resolve(ns, H) or []]

            def resolve_load() -> list[float]:
                answer = reader.resolve(ns, H, acquire=False, lease_ttl_ms=0, min_blocks=0, request_id="r")
                return [m.load for m in answer.result(5.0).matches]

            assert wait_for(lambda: mirror_load() == [0.0], 10.0), "the mirror never named the holder"
            assert resolve_load() == [0.0]
            started = time.monotonic()
            holder.set_load(7)
            assert wait_for(lambda: mirror_load() == [7.0], 5.0), f"mirror: {mirror_load()}"
            assert resolve_load() == [7.0]
            # Soon after that report: this one waits for its turn (LOAD_REPORT_S), then goes out.
            holder.set_load(0)
            assert wait_for(lambda: mirror_load() == [0.0], 5.0), f"mirror: {mirror_load()}"
            assert resolve_load() == [0.0]
            assert time.monotonic() - started < SESSION_TTL_MS / 3000, "no heartbeat came between"
        finally:
            holder.close()
            reader.close()
