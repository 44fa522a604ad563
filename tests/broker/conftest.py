from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import RunningServer, running_broker
from testkit.redis_cluster import RedisCluster, running_cluster
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
def own_redis(redis_server: RedisServer) -> Iterator[RedisServer]:
    """A redis-server of the test's own (started), for a test that stops or pauses its store."""
    store = RedisServer(redis_server.workdir / f"own-{secrets.token_hex(3)}")
    store.start()
    try:
        yield store
    finally:
        store.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A real 3-primary Redis Cluster (three redis-server processes) for the session's tests."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    with running_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(params=["in-memory", "redis", "redis-cluster"])
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[RunningServer]:
    """A real broker with its state in process, one with its state in a real redis-server, and one
    over a real 3-primary Redis Cluster."""
    state: dict[str, str] = {}
    if request.param != "in-memory":
        server: RedisServer | RedisCluster = request.getfixturevalue(
            "redis_server" if request.param == "redis" else "redis_cluster"
        )
        state = {"state": server.url, "state_prefix": f"t{secrets.token_hex(4)}"}
    async with running_broker(
        **state,
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
