"""Mirror streams across broker replicas are fed from a Redis Stream per layout, not from pub/sub: an
index change made through one replica while another's connection to Redis was cut still reaches the
mirror on the other once it reconnects and reads on from its last entry; changes trimmed away before
it came back make it resync that layout's mirrors (a fresh snapshot) instead of missing them. A
replica reads only the layouts it has mirrors for. On a standalone Redis and on a Cluster."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.mirror import FleetMirrorHub
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from testkit.redis_cluster import RedisCluster
from testkit.redis_server import RedisServer
from testkit.waiting import until
from tests.broker.helpers import redis_state

NS = Namespace("layout-m", "")
OTHER = Namespace("layout-n", "")


@pytest.fixture(params=["redis", "redis-cluster"])
def store(request: pytest.FixtureRequest) -> RedisServer | RedisCluster:
    found: RedisServer | RedisCluster = request.getfixturevalue(
        "redis_server" if request.param == "redis" else "redis_cluster"
    )
    return found


def node_clients(store: RedisServer | RedisCluster) -> Iterator[Any]:
    if isinstance(store, RedisCluster):
        yield from (node.client() for node in store.nodes)
    else:
        yield redis.Redis.from_url(store.url)


def cut_connections(store: RedisServer | RedisCluster, name: str) -> int:
    """CLIENT KILL every connection named `name`, on every node: as a network cut would."""
    killed = 0
    for client in node_clients(store):
        for conn in client.client_list():
            if conn.get("name") == name:
                killed += client.client_kill_filter(_id=conn["id"])
        client.close()
    return killed


def replica(state: RedisState, name: str) -> FleetMirrorHub:
    return FleetMirrorHub(state, name)


def blocks_of(updates: list[pb.MirrorUpdate]) -> list[tuple[list[int], list[int]]]:
    return [(list(b.stored), list(b.removed)) for u in updates for b in u.blocks]


async def test_a_change_made_while_a_replica_was_cut_off_reaches_its_mirror(
    store: RedisServer | RedisCluster,
) -> None:
    state = redis_state(store)
    a, b = replica(state, "a"), replica(state, "b")
    sub = b.subscribe(NS.layout_id, lambda: None)
    try:
        a.blocks("P", NS, Tier.GPU, stored=[1, 2])
        await until(lambda: sub.segments, message="b's mirror never heard of a's change")
        assert blocks_of(sub.take()) == [([1, 2], [])]

        # b's connection is cut; a changes the index before b is back. Pub/sub would have
        # dropped these; the stream keeps them for b.
        await until(lambda: cut_connections(store, "kvbroker-mirror-b") == 1)
        a.blocks("P", NS, Tier.GPU, stored=[3], removed=[1])
        a.engine(NS.layout_id, None, "Q")
        await until(lambda: len(sub.segments) == 2, message="b did not read on from its last entry")
        assert b.streams.readers[NS.layout_id].reconnects >= 1  # it really was cut off
        updates = sub.take()
        assert blocks_of(updates) == [([3], [1])]
        assert [(e.engine.engine_id, e.gone) for u in updates for e in u.engines] == [("Q", True)]
        assert not sub.overflowed

        # Cut off while the changes it missed were trimmed away: it resyncs instead of replaying.
        await until(lambda: cut_connections(store, "kvbroker-mirror-b") == 1)
        a.blocks("P", NS, Tier.GPU, stored=[4])
        state.call(state.client.xtrim, a.streams.keys(NS.layout_id)[0], maxlen=0)
        a.blocks("P", NS, Tier.GPU, stored=[5])
        await until(lambda: sub.overflowed, message="b missed trimmed changes without resyncing")
        assert sub.segments == []
    finally:
        await b.streams.stop()


async def test_a_replica_reads_only_its_mirrors_layouts_and_skips_its_own_changes(
    store: RedisServer | RedisCluster,
) -> None:
    state = redis_state(store)
    a, b = replica(state, "a"), replica(state, "b")
    sub = a.subscribe(NS.layout_id, lambda: None)
    try:
        a.blocks("P", NS, Tier.GPU, stored=[7])
        a.blocks("P", OTHER, Tier.GPU, stored=[8])
        assert blocks_of(sub.take()) == [([7], [])]  # its own change, at once
        reader = a.streams.readers[NS.layout_id]
        await until(lambda: reader.last_n > 0)  # read back from the stream ...
        await asyncio.sleep(0.2)
        assert sub.segments == []  # ... and not applied twice
        assert list(a.streams.readers) == [NS.layout_id]
        a.unsubscribe(sub)
        assert a.streams.readers == {}
        await until(lambda: reader.task is not None and reader.task.done())

        # A mirror that leaves and one that comes right after: the new one has a reader of its own.
        again = a.subscribe(NS.layout_id, lambda: None)
        a.unsubscribe(again)
        again = a.subscribe(NS.layout_id, lambda: None)
        b.blocks("P", NS, Tier.GPU, stored=[9])
        await until(lambda: again.segments, message="the new mirror missed another replica's change")
        assert blocks_of(again.take()) == [([9], [])]
    finally:
        await a.streams.stop()


async def test_a_stream_under_an_index_bytes_budget_keeps_to_its_bytes_and_a_reader_behind_it_resyncs(
    store: RedisServer | RedisCluster,
) -> None:
    """Under --index-memory-mib each layout's stream keeps to its share of the budget
    (index_bytes.STREAM_SHARE), trimmed by count at every append at what its entries cost: however
    fast the index changes, the stream's bytes stay near the share, small entries or large; and a
    replica that was away for more than the stream keeps resyncs its mirrors instead of missing
    changes."""
    state = redis_state(store)
    a, b = replica(state, "a"), replica(state, "b")
    share = 64 * 1024
    a.streams.keep_bytes(share)
    key = a.streams.keys(NS.layout_id)[0]
    sub = b.subscribe(NS.layout_id, lambda: None)
    try:
        await until(lambda: cut_connections(store, "kvbroker-mirror-b") == 1)
        for n, size in ((1_500, 1), (300, 256)):  # one block a change, then 256-block announcements
            for h in range(n):
                a.blocks("P", NS, Tier.GPU, stored=[size * h + i + 1 for i in range(size)])
            kept = int(state.call(state.client.memory_usage, key, samples=0) or 0)
            entries = int(state.call(state.client.xlen, key))
            # `~`: whole nodes go, never part of one: up to a node's worth more than the cap.
            assert 0.5 * share <= kept <= 1.3 * share, f"{kept} bytes in {entries} entries, share {share}"
            assert entries < n, "never trimmed by count"
        await until(lambda: sub.overflowed, message="b missed changes trimmed by count without resyncing")
    finally:
        await b.streams.stop()
