"""Retention on a real `kvbroker serve` process: its flag, its TTL run by the broker's own expiry
loop (the holder is told to unpin, watchers see why), and its per-tenant quota."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvbroker.common.error_details import error_info
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info
from testkit.processes import BrokerProcess
from tests.broker.session_util import RawSession

pytestmark = pytest.mark.timeout(120)

H = list(range(9000, 9008))


async def test_a_retention_ends_at_its_ttl_and_the_quota_bounds_a_tenant(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path, ["--max-retentions-per-tenant", "1", "--expiry-interval-ms", "20"])
    broker.start()
    try:
        async with grpc.aio.insecure_channel(broker.address) as channel:
            stub = broker_pb2_grpc.KVBrokerStub(channel)
            p = RawSession(stub)
            reg = await p.register(engine_info("P"), 60_000)
            ns = pb.Namespace(layout_id=reg.layout_id, tenant="t1")
            await p.announce(ns, pb.TIER_GPU, H)
            await p.applied()
            watch = stub.Watch(pb.WatchRequest(lease_events=True))
            call = asyncio.ensure_future(
                stub.Retain(
                    pb.RetainRequest(namespace=ns, block_hashes=H, ttl_ms=2_000, key="s1"), timeout=30
                )
            )
            pin = (await p.read_kind("pin", timeout=30)).pin.lease
            await p.send(pin_result=pb.PinResult(lease_id=pin.lease_id, ok=True, block_ids=range(len(H))))
            lease = (await call).lease
            assert lease.state == pb.LEASE_ACTIVE and lease.reader_engine_id == ""

            # The tenant keeps one retention (--max-retentions-per-tenant 1): a second is refused.
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Retain(pb.RetainRequest(namespace=ns, block_hashes=H, ttl_ms=500), timeout=30)
            info = error_info(exc.value.trailing_metadata())
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert info is not None and info.cause == "quota_exceeded"
            assert "--max-retentions-per-tenant 1" in (exc.value.details() or "")

            # Nobody renews it: the broker's expiry loop ends it, tells the holder, and watchers see why.
            ended = (await p.read_kind("lease_ended", timeout=30)).lease_ended.lease
            assert ended.lease_id == lease.lease_id and ended.cause == pb.REVOKE_TTL_EXPIRED
            async for event in watch:
                if event.kind == "lease_revoked" and event.lease.lease_id == lease.lease_id:
                    assert event.lease.request_id == "retain:s1"
                    break
            watch.cancel()
            # Its quota share is free again.
            call = asyncio.ensure_future(
                stub.Retain(pb.RetainRequest(namespace=ns, block_hashes=H, ttl_ms=500), timeout=30)
            )
            pin = (await p.read_kind("pin", timeout=30)).pin.lease
            await p.send(pin_result=pb.PinResult(lease_id=pin.lease_id, ok=True, block_ids=range(len(H))))
            assert (await call).lease.state == pb.LEASE_ACTIVE
            await p.close()
    finally:
        broker.stop()
