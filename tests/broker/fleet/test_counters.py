"""The fleet's Stats counters in the shared store: each replica flushes what it counted since its last
flush; Stats on any replica is the store's totals plus its own unflushed part; a flush retried after its
answer was lost counts once. On a standalone Redis and on a Cluster; as real processes (Stats and
/metrics on two replicas): tests/process/test_replicas_fleet_view.py."""

from __future__ import annotations

import pytest

from kvbroker.broker.fleet.counters import FleetCounters
from kvbroker.broker.results import Stats
from testkit.redis_cluster import RedisCluster
from testkit.redis_server import RedisServer
from tests.broker.helpers import redis_state

CAUSES = ("operator", "ttl_expired", "declined")


@pytest.fixture(params=["redis", "redis-cluster"])
def store(request: pytest.FixtureRequest) -> RedisServer | RedisCluster:
    found: RedisServer | RedisCluster = request.getfixturevalue(
        "redis_server" if request.param == "redis" else "redis_cluster"
    )
    return found


def local_stats(revoked: dict[str, int], released: int) -> Stats:
    """A replica's own Stats, as BrokerCore.stats() builds it."""
    by_state = {"pending": 0, "held": 2, "active": 1, "released": released, "revoked": sum(revoked.values())}
    return Stats(4, 4, 10, 1, by_state, dict(revoked))


def test_stats_on_any_replica_count_the_fleet_once(store: RedisServer | RedisCluster) -> None:
    state = redis_state(store)
    counts = {"a": dict.fromkeys(CAUSES, 0), "b": dict.fromkeys(CAUSES, 0)}
    released = {"a": 0, "b": 0}

    def counted(name: str) -> dict[str, int]:
        return {**{f"revoked:{c}": n for c, n in counts[name].items()}, "released": released[name]}

    a = FleetCounters(state, "a", lambda: counted("a"))
    b = FleetCounters(state, "b", lambda: counted("b"))

    counts["a"]["operator"] += 1
    released["b"] += 2
    # Not flushed yet: each sees its own at once, not the other's.
    seen = a.stats(local_stats(counts["a"], released["a"]))
    assert seen.revocations_by_cause["operator"] == 1 and seen.leases_by_state["released"] == 0
    a.flush()
    b.flush()
    for replica, name in ((a, "a"), (b, "b")):
        fleet = replica.stats(local_stats(counts[name], released[name]))
        assert fleet.revocations_by_cause == {"operator": 1, "ttl_expired": 0, "declined": 0}
        assert fleet.leases_by_state["released"] == 2 and fleet.leases_by_state["revoked"] == 1
        assert fleet.leases_by_state["held"] == 2  # live counts are the store's already: kept

    # A flush whose answer was lost is sent again as it was: counted once.
    counts["b"]["declined"] += 1
    b.flush()
    b._batch = {"revoked:declined": 1}  # as if its answer had been lost: the same flush goes again
    b.flush()
    counts["a"]["ttl_expired"] += 3
    a.flush()
    a.flush()  # nothing new: nothing sent
    fleet = a.stats(local_stats(counts["a"], released["a"]))
    assert fleet.revocations_by_cause == {"operator": 1, "ttl_expired": 3, "declined": 1}
    assert fleet.leases_by_state["revoked"] == 5
