"""The Mirrors contract: every backend must pass these (in-memory, Redis, and a Redis Cluster).

A fleet's hub hands its own replica's changes to its mirrors exactly as the in-memory one does; the
other replicas' changes reach them through the layout's stream (test_fleet_mirror_stream.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvbroker.broker.fleet.mirror import FleetMirrorHub
from kvbroker.broker.mirror import MirrorHub, Mirrors
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from tests.broker.helpers import redis_state

NS = Namespace("layout-m", "")
OTHER = Namespace("layout-n", "")


@pytest.fixture(params=["in-memory", "redis", "redis-cluster"])
async def hub(request: pytest.FixtureRequest) -> AsyncIterator[Mirrors]:
    if request.param == "in-memory":
        yield MirrorHub()
        return
    # A real redis-server, or a real 3-primary Redis Cluster, started by the tests.
    store = request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
    fleet = FleetMirrorHub(redis_state(store), "r1")
    try:
        yield fleet
    finally:
        await fleet.streams.stop()


def changes(updates: list[pb.MirrorUpdate]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for u in updates:
        out += [("engine", e.engine.engine_id, "gone" if e.gone else "") for e in u.engines]
        out += [
            ("blocks", b.engine_id, f"{list(b.stored)}-{list(b.removed)}-{b.clear_tier}") for b in u.blocks
        ]
    return out


async def test_a_mirror_gets_its_layouts_changes_in_order(hub: Mirrors) -> None:
    woken: list[int] = []
    sub = hub.subscribe(NS.layout_id, lambda: woken.append(1))
    assert hub.watching(NS.layout_id) and hub.subscriber_count() == 1
    hub.blocks("P", NS, Tier.GPU, stored=[1, 2])
    hub.blocks("P", OTHER, Tier.GPU, stored=[9])  # another layout: not this mirror's
    hub.engine(NS.layout_id, None, "Q")
    hub.clear_tier("P", NS.layout_id, Tier.CPU)
    hub.engine(NS.layout_id, engine_info("R"))
    assert woken
    assert changes(sub.take()) == [
        ("blocks", "P", "[1, 2]-[]-False"),
        ("engine", "Q", "gone"),
        ("blocks", "P", "[]-[]-True"),
        ("engine", "R", ""),
    ]
    assert sub.take() == [] and hub.lag() == (0.0, 0)


async def test_a_mirror_hears_an_engine_without_its_nixl_metadata(hub: Mirrors) -> None:
    sub = hub.subscribe(NS.layout_id, lambda: None)
    hub.engine(NS.layout_id, engine_info("R", agent_metadata=b"secret-ish"))
    (update,) = sub.take()
    assert update.engines[0].engine.ranks[0].agent_metadata == b""


async def test_what_waits_is_counted_until_taken(hub: Mirrors) -> None:
    sub = hub.subscribe(NS.layout_id, lambda: None)
    hub.blocks("P", NS, Tier.GPU, stored=list(range(100)))
    age, pending = hub.lag()
    assert pending > 800 and age >= 0.0
    sub.take()
    assert hub.lag() == (0.0, 0)


async def test_a_mirror_too_far_behind_is_resynced_not_grown(hub: Mirrors) -> None:
    sub = hub.subscribe(NS.layout_id, lambda: None, max_pending=1000)
    for i in range(20):
        hub.blocks("P", NS, Tier.GPU, stored=list(range(i * 10, i * 10 + 10)))
    assert sub.overflowed and sub.segments == []
    sub.restart()
    hub.blocks("P", NS, Tier.GPU, stored=[1])
    assert changes(sub.take()) == [("blocks", "P", "[1]-[]-False")]


async def test_a_mirror_that_left_hears_nothing_and_shutdown_ends_the_rest(hub: Mirrors) -> None:
    gone = hub.subscribe(NS.layout_id, lambda: None)
    staying = hub.subscribe(NS.layout_id, lambda: None)
    hub.unsubscribe(gone)
    assert hub.subscriber_count() == 1
    hub.blocks("P", NS, Tier.GPU, stored=[1])
    assert gone.take() == [] and len(staying.take()) == 1
    hub.close_all("broker is shutting down")
    assert staying.closed == "broker is shutting down" and gone.closed == ""
    hub.unsubscribe(staying)
    assert hub.subscriber_count() == 0
