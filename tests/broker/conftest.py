from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import RunningServer, running_broker
from testkit.redis_server import RedisServer, missing_reason, running_redis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session's tests (each test uses its own key prefix)."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


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
