"""Early declines across broker replicas: one replica's early decline reaches every other replica's
book through the fleet's declines stream (a hold there is then refused), and the replica that hears it
is asked to end a hold that came meanwhile; a replica does not hear its own back. On a standalone
Redis and on a Cluster; as real processes: tests/process/test_replicas_fleet_view.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvbroker.broker.fleet.declines import FleetDeclineBook
from testkit.redis_cluster import RedisCluster
from testkit.redis_server import RedisServer
from testkit.waiting import until
from tests.broker.helpers import redis_state


@pytest.fixture(params=["redis", "redis-cluster"])
def store(request: pytest.FixtureRequest) -> RedisServer | RedisCluster:
    found: RedisServer | RedisCluster = request.getfixturevalue(
        "redis_server" if request.param == "redis" else "redis_cluster"
    )
    return found


async def test_an_early_decline_reaches_every_replicas_book_once(store: RedisServer | RedisCluster) -> None:
    state = redis_state(store)
    a, b = FleetDeclineBook(state, "a", time.time), FleetDeclineBook(state, "b", time.time)
    heard: dict[str, list[tuple[str, str]]] = {"a": [], "b": []}
    a.on_heard = lambda *said: heard["a"].append(said)
    b.on_heard = lambda *said: heard["b"].append(said)
    a.follow()
    b.follow()
    try:
        a.add("P", "r1", time.time())
        await until(lambda: heard["b"], message="b never heard of a's early decline")
        assert heard["b"] == [("P", "r1")]
        assert b.take("P", "r1", time.time())  # a hold of it through b is refused ...
        assert not b.take("P", "r1", time.time())  # ... once
        assert a.take("P", "r1", time.time())  # a has its own
        await asyncio.sleep(0.1)
        assert heard["a"] == []  # a does not hear its own back (nor b's echo: b sent none)
        assert len(a) == 0 and len(b) == 0
    finally:
        await asyncio.gather(a.stream.stop(), b.stream.stop())
