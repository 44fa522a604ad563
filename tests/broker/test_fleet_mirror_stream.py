"""Mirror streams across broker replicas are fed from a Redis Stream, not from pub/sub: an index
change made through one replica while another was away from Redis still reaches the mirrors on the
other once it reads on from its last entry; changes trimmed away before it came back make it resync
its mirrors (a fresh snapshot) instead of missing them. On a standalone Redis and on a Cluster."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvbroker.broker.state_redis_conn import RedisState
from kvbroker.broker.state_redis_notify import FleetMirrorHub, FleetNotifier
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from testkit.clock import FakeClock
from testkit.waiting import until
from tests.broker.helpers import redis_state

NS = Namespace("layout-m", "")


@pytest.fixture(params=["redis", "redis-cluster"])
def state(request: pytest.FixtureRequest) -> RedisState:
    return redis_state(
        request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
    )


def replica(state: RedisState, name: str) -> FleetNotifier:
    notifier = FleetNotifier(FakeClock(), state, name)
    notifier.mirrors = FleetMirrorHub(notifier)
    return notifier


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def blocks_of(updates: list[pb.MirrorUpdate]) -> list[tuple[list[int], list[int]]]:
    return [(list(b.stored), list(b.removed)) for u in updates for b in u.blocks]


async def test_a_change_made_while_a_replica_was_away_reaches_its_mirror(state: RedisState) -> None:
    a, b = replica(state, "a"), replica(state, "b")
    assert a.mirrors is not None and b.mirrors is not None
    sub = b.mirrors.subscribe(NS.layout_id, lambda: None)
    reading = asyncio.create_task(b.follow_mirror(block_ms=100))
    try:
        a.mirrors.blocks("P", NS, Tier.GPU, stored=[1, 2])
        await until(lambda: sub.segments, message="b's mirror never heard of a's change")
        assert blocks_of(sub.take()) == [([1, 2], [])]

        # b is away from Redis (its reader gone); a changes the index meanwhile. Pub/sub would
        # have dropped these; the stream keeps them for b.
        await stop(reading)
        a.mirrors.blocks("P", NS, Tier.GPU, stored=[3], removed=[1])
        a.mirrors.engine(NS.layout_id, None, "Q")
        reading = asyncio.create_task(b.follow_mirror(block_ms=100))
        await until(lambda: len(sub.segments) == 2, message="b did not read on from its last entry")
        updates = sub.take()
        assert blocks_of(updates) == [([3], [1])]
        assert [(e.engine.engine_id, e.gone) for u in updates for e in u.engines] == [("Q", True)]
        assert not sub.overflowed

        # Away longer than the stream keeps: b cannot replay, so its mirrors start over.
        await stop(reading)
        a.mirrors.blocks("P", NS, Tier.GPU, stored=[4])
        state.call(state.client.xtrim, a.mirror_stream, maxlen=0)
        a.mirrors.blocks("P", NS, Tier.GPU, stored=[5])
        reading = asyncio.create_task(b.follow_mirror(block_ms=100))
        await until(lambda: sub.overflowed, message="b missed trimmed changes without resyncing")
        assert sub.segments == []
    finally:
        await stop(reading)


async def test_a_replica_applies_only_the_others_changes(state: RedisState) -> None:
    """Its own changes reach its mirrors at once, when made; read back from the stream they are skipped."""
    a = replica(state, "a")
    assert a.mirrors is not None
    sub = a.mirrors.subscribe(NS.layout_id, lambda: None)
    reading = asyncio.create_task(a.follow_mirror(block_ms=100))
    try:
        a.mirrors.blocks("P", NS, Tier.GPU, stored=[7])
        assert blocks_of(sub.take()) == [([7], [])]
        await until(lambda: a.mirror_n > 0)
        await asyncio.sleep(0.2)
        assert sub.segments == []
    finally:
        await stop(reading)
