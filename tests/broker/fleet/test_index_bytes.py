"""--index-memory-mib with --state (broker/fleet/index_bytes.py): the store's index kept to a bytes
budget through an entry bound derived from Redis's own MEMORY USAGE of the index's keys. The rule
with fakes, then on a real redis-server and a real Redis Cluster: ten times the budget announced,
the index keys' exact bytes stay within 10% of it."""

from __future__ import annotations

import random

import pytest

from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.index import RedisPrefixIndex, namespace_id
from kvbroker.broker.fleet.index_bytes import (
    MIN_SAMPLE_ENTRIES,
    NAMESPACE_KEYS,
    PRIOR_BYTES_PER_ENTRY,
    STREAM_SHARE,
    StoreEntryBytes,
    entry_bound,
    sample_namespaces,
)
from kvbroker.common.model import Namespace, Tier
from tests.broker.helpers import redis_state

NS = Namespace("layout-a", "")
BUDGET = 256 * 1024
ENTRIES_SHARE = BUDGET - int(BUDGET * STREAM_SHARE)  # what the entries get while the streams keep to theirs


def test_the_bound_is_the_budget_over_the_bytes_an_entry_costs() -> None:
    assert entry_bound(1024 * 1024, 163.0) == 6432
    assert entry_bound(100, 1_000.0) == 1  # never 0: 0 means unbounded
    sizes = [(n, f"ns{n}") for n in (0, 5, 900, 40, 7000, 3, 60)]
    picked = sample_namespaces(sizes, 4, random.Random(1))
    assert [n for n, _ in picked[:2]] == [7000, 900]  # the largest half ...
    assert len(picked) == 4 and all(n > 0 for n, _ in picked)  # ... the rest at random, never empty ones


def test_the_stores_figure_replaces_the_prior_once_the_sample_says_something() -> None:
    sizing = StoreEntryBytes(BUDGET, seed=1)
    assert sizing.per_entry == PRIOR_BYTES_PER_ENTRY and sizing.bound == ENTRIES_SHARE // 163
    keys = lambda nsid: [f"{nsid}:{k}" for k in NAMESPACE_KEYS]  # noqa: E731
    # Too few entries sampled: per-key overhead, not entries; the prior stays.
    assert not sizing.calibrate([(MIN_SAMPLE_ENTRIES - 1, "a")], keys, lambda key: 10_000)
    assert not sizing.measured and sizing.per_entry == PRIOR_BYTES_PER_ENTRY
    asked: list[str] = []

    def usage(key: str) -> int:
        asked.append(key)
        return 200_000 if key.endswith(":ix") else 100_000 if key.endswith(":lru") else 100

    assert sizing.calibrate([(3_000, "a"), (2_000, "b")], keys, usage)
    assert sorted(asked) == sorted(keys("a") + keys("b"))  # every key of each sampled namespace
    assert sizing.measured and sizing.per_entry == pytest.approx((300_000 * 2 + 100 * 10) / 5_000)
    assert sizing.bound == entry_bound(ENTRIES_SHARE, sizing.per_entry)


@pytest.fixture(params=["redis", "redis-cluster"])
def state(request: pytest.FixtureRequest) -> RedisState:
    return redis_state(
        request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
    )


def index_bytes(state: RedisState, index: RedisPrefixIndex) -> int:
    """Redis's exact count (MEMORY USAGE SAMPLES 0) of every key of the namespace's index."""
    keys = index._keys(namespace_id(NS), *NAMESPACE_KEYS)
    return sum(int(state.client.memory_usage(k, samples=0) or 0) for k in keys)


def test_ten_times_the_budget_announced_the_index_keys_stay_within_ten_percent(state: RedisState) -> None:
    index = RedisPrefixIndex(state, memory_bytes=BUDGET)
    assert index.memory().entry_cap == ENTRIES_SHARE // 163  # the prior, until the store is asked
    rng = random.Random(7)
    announced = 0
    while announced < 10 * BUDGET // 163:
        for _ in range(10):
            index.add("a", Tier.GPU, NS, [rng.getrandbits(64) for _ in range(100)])
            announced += 100
        index._recount_at = 0.0  # as if RECOUNT_S had passed: recount, and ask the store again
        index.maintain(64)
    memory = index.memory()
    used = index_bytes(state, index)
    assert memory.budget_bytes == BUDGET and memory.forgotten > 0
    assert index._bytes is not None and index._bytes.measured, "the store's own figure was never taken"
    assert memory.entries <= memory.entry_cap == entry_bound(ENTRIES_SHARE, index._bytes.per_entry)
    assert 0.5 * BUDGET <= used <= 1.10 * BUDGET, f"{used} bytes against a budget of {BUDGET}"
    assert memory.estimated_bytes == pytest.approx(used, rel=0.2)


def test_entries_and_bytes_are_not_both_a_bound(state: RedisState) -> None:
    with pytest.raises(ValueError, match="not both"):
        RedisPrefixIndex(state, max_entries=10, memory_bytes=BUDGET)


def test_the_streams_keep_to_their_share_and_a_larger_measure_comes_off_the_entries() -> None:
    sizing = StoreEntryBytes(BUDGET, seed=1)
    share = int(BUDGET * STREAM_SHARE)
    assert sizing.stream_bytes == share  # one stream until the recount says how many
    # Streams within their share: the entries keep the rest, whatever the streams hold now.
    sizing.measure_beside([["s1", "n1"], ["s2", "n2"]], {"s1": 4 * 1024, "s2": 2 * 1024}.get)
    assert sizing.beside_bytes == 6 * 1024 and sizing.bound == entry_bound(
        ENTRIES_SHARE, PRIOR_BYTES_PER_ENTRY
    )
    assert sizing.stream_bytes == share // 2  # split between two layouts
    # Past their share (the trim is approximate): the excess comes off the entries.
    sizing.measure_beside([["s1"]], lambda key: share + 64 * 1024)
    assert sizing.bound == entry_bound(BUDGET - share - 64 * 1024, PRIOR_BYTES_PER_ENTRY)
    sizing.measure_beside([["s1"]], lambda key: 2 * BUDGET)  # the streams alone past the budget
    assert sizing.bound == 1, "a bound of one entry, never 0 (unbounded)"


def test_a_layouts_change_stream_counts_in_the_budget(state: RedisState) -> None:
    """A real stream of about 100 KiB beside a 256 KiB budget: the recount measures it and the
    entry bound is what the rest of the budget holds."""
    stream = f"{state.prefix}:{{mirror-test}}:s"
    told: list[int] = []  # the bytes the replica's mirror streams are told to keep (stream_bytes)
    index = RedisPrefixIndex(
        state,
        memory_bytes=BUDGET,
        stream_keys=lambda lid: [stream] if lid == NS.layout_id else [],
        stream_bytes=told.append,
    )
    assert told == [int(BUDGET * STREAM_SHARE)]  # from the start, for one stream
    index.add("a", Tier.GPU, NS, list(range(1, 101)))
    before = index.memory().entry_cap
    for i in range(100):
        state.client.xadd(stream, {"b": b"x" * 1000, "n": i})
    index._recount_at = 0.0
    index.maintain(64)
    assert index._bytes is not None
    streamed = int(state.client.memory_usage(stream, samples=0) or 0)
    assert index._bytes.beside_bytes == pytest.approx(streamed, rel=0.2) and streamed > 90_000
    assert index.memory().entry_cap == entry_bound(BUDGET - index._bytes.beside_bytes, index._bytes.per_entry)
    assert told[-1] == int(BUDGET * STREAM_SHARE)  # one layout's stream: the whole share
    assert index.memory().entry_cap < before * 0.7
    entries = index.memory().entries
    assert index.memory().estimated_bytes == int(entries * index._bytes.per_entry) + index._bytes.beside_bytes
