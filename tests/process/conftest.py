"""Fixtures for the process-level tests: a real `kvbroker serve` (testkit.processes) and
engine client processes (process_harness.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from process_harness import EngineProcess, child_env

from testkit.processes import SERVE, BrokerProcess
from testkit.redis_cluster import RedisCluster, running_cluster
from testkit.redis_server import RedisServer, missing_reason, running_redis


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[BrokerProcess]:
    # `kvbroker serve` as a user runs it: default log level and priority.
    broker = BrokerProcess(
        tmp_path,
        ["--session-ttl-min-ms", "100", "--expiry-interval-ms", "20"],
        command=SERVE,
        log_level=None,
        priority=None,
        env=child_env(),
    )
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def engine_processes() -> Iterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    yield started
    for engine in started:
        engine.close()


@pytest.fixture(params=["redis", "redis-cluster"])
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer | RedisCluster]:
    """One redis-server, or a 3-primary Redis Cluster (the replicas get its seed nodes)."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    if request.param == "redis":
        with running_redis(tmp_path / "redis") as server:
            yield server
    else:
        with running_cluster(tmp_path / "redis-cluster") as cluster:
            yield cluster
