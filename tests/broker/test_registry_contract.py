"""The Registry contract: every backend must pass these (in-memory, Redis, and a Redis Cluster).

What only a fleet does (another replica's engines, resuming a session, claiming an owner's expired
sessions) is tested with two replicas in test_shared_state.py and tests/process/."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvbroker.broker.errors import InvalidArgument, NotFound
from kvbroker.broker.fleet.leases import RedisLeaseTable
from kvbroker.broker.fleet.notify import FleetNotifier
from kvbroker.broker.fleet.registry import FleetRegistry, SeenRecords
from kvbroker.broker.registry import EngineRegistry, Registry
from kvbroker.common.layout import layout_id
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.clock import FakeClock
from testkit.redis_cluster import RedisCluster
from testkit.redis_server import RedisServer
from tests.broker.helpers import redis_state


def _fleet(store: RedisServer | RedisCluster) -> FleetRegistry:
    state = redis_state(store)
    seen = SeenRecords()
    notifier = FleetNotifier(FakeClock(), state, "r1", seen, RedisLeaseTable(state, history=4))
    return FleetRegistry(state, "r1", seen, notifier)


BACKENDS: dict[str, Callable[[pytest.FixtureRequest], Registry]] = {
    "in-memory": lambda _: EngineRegistry(),
    # A real redis-server started by the tests (skipped, with the reason, where none can run).
    "redis": lambda request: _fleet(request.getfixturevalue("redis_server")),
    # A real 3-primary Redis Cluster started by the tests: the fleet's keys on one slot.
    "redis-cluster": lambda request: _fleet(request.getfixturevalue("redis_cluster")),
}


@pytest.fixture(params=list(BACKENDS))
def registry(request: pytest.FixtureRequest) -> Registry:
    return BACKENDS[request.param](request)


def test_an_added_engine_is_found_every_way_until_removed(registry: Registry) -> None:
    info = engine_info("P")
    rec = registry.add(info, ttl_s=10.0, expected_ranks=1, now=0.0)
    assert rec.engine_id == "P" and rec.session_id and rec.deadline == 10.0
    assert rec.layout_id == layout_id(info.layout) and rec.ready
    assert registry.get("P") is rec and registry.find("P") is rec
    assert registry.by_session(rec.session_id) is rec
    assert [r.engine_id for r in registry.all()] == ["P"] and len(registry) == 1
    assert registry.find_fingerprint(rec.layout_id) == info.layout
    assert registry.owns(rec)

    registry.remove(rec)
    assert registry.find("P") is None and len(registry) == 0 and registry.all() == []
    with pytest.raises(NotFound, match="unknown engine 'P'"):
        registry.get("P")
    with pytest.raises(NotFound, match="unknown session"):
        registry.by_session(rec.session_id)
    assert registry.find_fingerprint(rec.layout_id) is None


def test_sessions_are_new_secrets_and_engines_are_told_apart(registry: Registry) -> None:
    p = registry.add(engine_info("P"), 10.0, 1, 0.0)
    d = registry.add(engine_info("D"), 10.0, 1, 0.0)
    assert p.session_id != d.session_id and len(p.session_id) >= 32
    assert {r.engine_id for r in registry.all()} == {"P", "D"} and len(registry) == 2
    assert registry.by_session(d.session_id).engine_id == "D"


def test_a_bad_registration_is_refused_and_adds_nothing(registry: Registry) -> None:
    with pytest.raises(InvalidArgument, match="engine_id is empty"):
        registry.add(engine_info(""), 10.0, 1, 0.0)
    twice = engine_info("P")
    twice.ranks.append(twice.ranks[0])
    with pytest.raises(InvalidArgument, match="listed twice"):
        registry.add(twice, 10.0, 1, 0.0)
    with pytest.raises(InvalidArgument, match="hash_algo"):
        registry.add(engine_info("P", hash_algo="md5"), 10.0, 1, 0.0)
    assert len(registry) == 0 and registry.find("P") is None


def test_ranks_arrive_one_by_one(registry: Registry) -> None:
    info = engine_info("P", ranks=0, tp_size=2)
    rec = registry.add(info, 10.0, expected_ranks=2, now=0.0)
    assert not rec.ready and rec.ranks_version == 0
    for tp in range(2):
        rank = engine_info("P", tp_size=2).ranks[tp]
        rec = registry.add_rank("P", rank)
    assert rec.ready and rec.ranks_version == 2
    assert registry.get("P").snapshot().ranks[1].tp_rank == 1
    with pytest.raises(InvalidArgument, match="tp_rank must be < tp_size=2"):
        registry.add_rank("P", pb.RankInfo(tp_rank=5, start_layer=0, end_layer=1))
    with pytest.raises(NotFound):
        registry.add_rank("nobody", engine_info("P", tp_size=2).ranks[0])


def test_expired_names_passed_deadlines_once_the_owner_stops_moving_them(registry: Registry) -> None:
    p = registry.add(engine_info("P"), 1.0, 1, now=0.0)
    d = registry.add(engine_info("D"), 5.0, 1, now=0.0)
    assert registry.expired(0.5, limit=10) == []
    p.deadline = 3.0  # a heartbeat moved it: the queue catches up lazily
    assert registry.expired(2.0, limit=10) == []
    assert registry.expired(3.5, limit=10) == [p]
    assert registry.find("P") is p  # still registered until the caller removes it
    registry.remove(p)
    registry.extend_sessions(10.0)  # the broker stalled: every session gets the time back
    assert d.deadline == 15.0
    assert registry.expired(6.0, limit=10) == []
    assert registry.expired(15.5, limit=10) == [d]


def test_resuming_a_session_nobody_has_is_refused(registry: Registry) -> None:
    assert registry.resume(engine_info("P"), "0" * 32, 10.0, 1, 0.0) is None
    assert registry.find("P") is None


def test_incompatibility_says_why_a_reader_cannot_read_a_holder(registry: Registry) -> None:
    p = registry.add(engine_info("P"), 10.0, 1, 0.0)
    d = registry.add(engine_info("D"), 10.0, 1, 0.0)
    other = registry.add(engine_info("X", num_layers=4), 10.0, 1, 0.0)
    assert registry.incompatibility(d, p) is None
    assert "layout ids differ" in (registry.incompatibility(other, p) or "")
