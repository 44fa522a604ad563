from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import RunningServer, running_broker


@pytest.fixture
async def broker() -> AsyncIterator[RunningServer]:
    async with running_broker(
        session_ttl_min_ms=100,
        pin_timeout_ms=5000,
        max_hashes=1024,
        max_message_bytes=1 << 20,
        expiry_interval_ms=20,
        stop_grace=0.5,
    ) as running:
        yield running


@pytest.fixture
async def channel(broker: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(broker.address) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> broker_pb2_grpc.KVBrokerStub:
    return broker_pb2_grpc.KVBrokerStub(channel)
