from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.server import RunningServer, start_server
from kvbroker.v1 import broker_pb2_grpc


@pytest.fixture
async def broker() -> AsyncIterator[RunningServer]:
    running = await start_server(
        BrokerConfig(
            address="127.0.0.1:0",
            session_ttl_min_ms=100,
            pin_timeout_ms=5000,
            max_hashes=1024,
            max_message_bytes=1 << 20,
            expiry_interval_ms=20,
        )
    )
    yield running
    await running.stop(0.5)


@pytest.fixture
async def channel(broker: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(broker.address) as ch:
        yield ch


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> broker_pb2_grpc.KVBrokerStub:
    return broker_pb2_grpc.KVBrokerStub(channel)
