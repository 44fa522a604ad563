"""The broker's /metrics: the Session stream's hot path, pin waits, process metrics and
build info; metrics on by default, and off (with a warning) when the port is taken."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import urllib.request

import pytest

from kvbroker.broker.config import BrokerConfig
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import running_broker
from testkit.builders import engine_info
from testkit.ports import free_port
from tests.broker.session_util import RawSession


async def _scrape(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    return (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode()


def _value(body: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", body, re.MULTILINE)
    assert match is not None, f"{series} not in /metrics"
    return float(match.group(1))


def test_metrics_are_on_by_default() -> None:
    assert BrokerConfig().metrics_port == 9400


async def test_session_stream_resolves_inventory_and_pins_are_counted_and_timed() -> None:
    import grpc

    config = {"metrics_port": free_port(), "metrics_host": "127.0.0.1", "stop_grace": 0.5}
    async with running_broker(**config) as running, grpc.aio.insecure_channel(running.address) as channel:
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        holder, reader = RawSession(stub), RawSession(stub)
        reg = await holder.register(engine_info("H"))
        await reader.register(engine_info("R"))
        ns = pb.Namespace(layout_id=reg.layout_id)
        hashes = list(range(700, 708))
        await holder.announce(ns, pb.TIER_GPU, hashes)
        await holder.applied()
        assert (await reader.resolve(ns, hashes)).resolve.matches[0].matched_blocks == 8
        bad = await reader.resolve(pb.Namespace(layout_id="nope"), hashes)
        assert bad.error.code == "FAILED_PRECONDITION"  # another layout than the session's
        # No hold covers the blocks: the broker asks the holder to pin them for the reader.
        seq = await reader.send(
            resolve=pb.ResolveRequest(namespace=ns, block_hashes=hashes, acquire=True, lease_ttl_ms=5000)
        )
        pin = (await holder.read_kind("pin")).pin
        await holder.send(
            pin_result=pb.PinResult(lease_id=pin.lease.lease_id, ok=True, block_ids=list(range(8)))
        )
        while (down := await reader.read()).seq != seq:
            pass
        assert down.resolve.lease.lease_id == pin.lease.lease_id
        # The reader commits its read: the pair's totals and the lease's lifetime are counted.
        seq = await reader.send(release=pb.ReleaseRequest(lease_id=pin.lease.lease_id, reader_engine_id="R"))
        while (down := await reader.read()).seq != seq:
            pass
        assert down.lease.lease.state == pb.LEASE_RELEASED, down
        body = await _scrape(running.metrics_port)
        await holder.close()
        await reader.close()
    assert _value(body, 'kvbroker_session_messages_total{code="OK",kind="resolve"}') == 2
    assert _value(body, 'kvbroker_session_messages_total{code="FAILED_PRECONDITION",kind="resolve"}') == 1
    assert _value(body, 'kvbroker_session_messages_total{code="OK",kind="inventory"}') == 1
    assert _value(body, 'kvbroker_session_messages_total{code="OK",kind="pin_result"}') == 1
    assert _value(body, 'kvbroker_session_message_seconds_count{kind="resolve"}') == 3
    assert _value(body, 'kvbroker_pin_wait_seconds_count{outcome="pinned"}') == 1
    pair = 'holder="H",reader="R",tier="gpu"'
    assert _value(body, f"kvbroker_pair_reads_total{{{pair}}}") == 1
    assert _value(body, f"kvbroker_pair_blocks_total{{{pair}}}") == 8
    # The tests' layout: K and V x 2 layers x 2 KV heads x 16 x 32 tokens x 4 bytes (float32), 8 blocks.
    assert _value(body, f"kvbroker_pair_bytes_total{{{pair}}}") == 8 * 2 * 2 * 2 * 16 * 32 * 4
    # This reader did not say what it read (an older one): counted as the whole lease, and as such.
    assert _value(body, f"kvbroker_pair_unreported_reads_total{{{pair}}}") == 1
    assert _value(body, 'kvbroker_lease_duration_seconds_count{outcome="released"}') == 1
    assert _value(body, 'kvbroker_lease_duration_seconds_bucket{le="+Inf",outcome="released"}') == 1
    assert _value(body, "kvbroker_mirror_lag_seconds") == 0
    assert _value(body, "process_cpu_seconds_total") > 0
    assert re.search(r'^kvbroker_build_info\{grpc="[^"]+",python="[^"]+",version="[^"]+"\} 1\.0$', body, re.M)


async def test_a_taken_metrics_port_turns_metrics_off_and_the_broker_serves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import grpc

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="kvbroker.metrics"):
            async with running_broker(metrics_port=port, metrics_host="127.0.0.1", stop_grace=0.5) as running:
                assert running.metrics_port == 0
                async with grpc.aio.insecure_channel(running.address) as channel:
                    stats = await broker_pb2_grpc.KVBrokerStub(channel).Stats(pb.StatsRequest())
                    assert stats.engines == 0
    assert f"port {port}" in caplog.text and "taken" in caplog.text


def test_a_replicas_index_bytes_are_exported_only_under_a_bytes_budget() -> None:
    """With --state the store's estimate (entries at its measured bytes per entry, plus the mirror
    streams: broker/fleet/index.py) is exported when --index-memory-mib set a budget; an entry
    bound alone measures no bytes."""
    from types import SimpleNamespace

    from kvbroker.broker.metrics import BrokerCollector
    from kvbroker.common.index_budget import IndexMemory

    def exported(memory: IndexMemory) -> dict[str, float]:
        core = SimpleNamespace(index=SimpleNamespace(memory=lambda: memory))
        collector = BrokerCollector(core, fleet=lambda stats: stats)  # type: ignore[arg-type]
        return {m.name: m.samples[0].value for m in collector._index_memory()}

    budgeted = exported(
        IndexMemory(budget_bytes=1 << 20, estimated_bytes=900_000, entries=5_000, entry_cap=6_000)
    )
    assert budgeted["kvbroker_index_memory_estimated_bytes"] == 900_000
    assert budgeted["kvbroker_index_memory_budget_bytes"] == 1 << 20
    assert "kvbroker_index_memory_estimated_bytes" not in exported(
        IndexMemory(entries=5_000, entry_cap=6_000)
    )
