"""--index-max-entries on the store's index (broker/fleet/index_bound.py), on a real redis-server
and a real Redis Cluster: past the bound the least recently announced or matched blocks go,
those of the engine with the most blocks first among the oldest, in bounded work; answers stay
correct (a forgotten block is a miss, never a wrong holder); maintenance keeps to a bound that
was lowered; what went is handed over for the mirrors. The plain contract (with a bound never
reached): tests/broker/test_index_contract.py; on a real broker process:
tests/broker/test_index_memory.py."""

from __future__ import annotations

import random

import pytest

from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.index import RedisPrefixIndex
from kvbroker.broker.fleet.index_bound import FORGET_STEP, MAX_FORGET, forget_batch
from kvbroker.common.model import Namespace, Tier
from tests.broker.helpers import redis_state

NS = Namespace("layout-a", "")
OTHER = Namespace("layout-a", "tenant-2")
GPU = Tier.GPU


@pytest.fixture(params=["redis", "redis-cluster"])
def state(request: pytest.FixtureRequest) -> RedisState:
    return redis_state(
        request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
    )


def chains(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.getrandbits(64) for _ in range(length)] for _ in range(n)]


def matched(index: RedisPrefixIndex, chain: list[int], ns: Namespace = NS) -> dict[str, int]:
    return {engine: n for engine, _tier, n in index.longest_prefixes(ns, chain)}


def test_the_batch_is_the_excess_and_a_sixteenth_of_the_cap_at_most_max_forget() -> None:
    assert forget_batch(0, 10**9) == 0 and forget_batch(1600, 1600) == 0
    assert forget_batch(1600, 1610) == 10 + 100
    assert forget_batch(1600, 10**6) == MAX_FORGET and FORGET_STEP <= MAX_FORGET


def test_past_the_bound_the_least_recently_matched_go_and_answers_stay_correct(state: RedisState) -> None:
    index = RedisPrefixIndex(state, max_entries=200)
    a_chains, b_chains = chains(10, 20, seed=1), chains(10, 20, seed=2)
    for a, b in zip(a_chains[:5], b_chains[:5], strict=True):  # 200 entries: at the bound
        index.add("a", GPU, NS, a)
        index.add("b", GPU, NS, b)
    assert index.memory().entries == 200 and index.forgotten == 0
    assert matched(index, a_chains[0]) == {"a": 20}  # matched: the most recent of all
    gone = []  # what each announcement forgot, handed over after it (for the mirrors)
    for a, b in zip(a_chains[5:], b_chains[5:], strict=True):
        index.add("a", GPU, NS, a)
        gone += index.take_forgotten()
        index.add("b", GPU, NS, b)
        gone += index.take_forgotten()
        assert index.memory().entries <= 200  # kept after every announcement
        assert matched(index, a_chains[0]) == {"a": 20}  # a hot prefix, matched again and again
    memory = index.memory()
    assert memory.entry_cap == 200 and memory.forgotten == index.forgotten == 400 - memory.entries
    assert matched(index, a_chains[0]) == {"a": 20}, "the recently matched chain was forgotten"
    assert matched(index, b_chains[0]) == {}, "the oldest unmatched chain was kept"
    assert matched(index, a_chains[-1]) == {"a": 20} and matched(index, b_chains[-1]) == {"b": 20}
    # Never a wrong holder: each chain names its announcer or nobody, its prefix cut at a gap.
    for owner, owned in (("a", a_chains), ("b", b_chains)):
        for chain in owned:
            assert set(matched(index, chain)) <= {owner}
    assert sum(index.blocks_of(e)[GPU] for e in "ab") == index.total_blocks() == memory.entries
    # What went was handed over, per holder, once.
    assert sum(len(hashes) for _e, _t, _ns, hashes in gone) == index.forgotten
    assert {(e, t, ns) for e, t, ns, _h in gone} <= {("a", GPU, NS), ("b", GPU, NS)}
    for engine, _tier, _ns, hashes in gone:
        for h in hashes[:20]:
            assert engine not in matched(index, [h])
    assert index.take_forgotten() == []


def test_the_oldest_go_first_whoever_holds_them_each_chain_from_its_end(state: RedisState) -> None:
    index = RedisPrefixIndex(state, max_entries=100)
    (small,) = chains(1, 10, seed=3)
    (big,) = chains(1, 80, seed=4)
    index.add("small", GPU, NS, small)  # the oldest of all
    index.add("big", GPU, NS, big)
    index.add("new", GPU, NS, chains(1, 20, seed=5)[0])  # 110: 10 over, forget 10 + 6
    assert matched(index, small) == {}
    assert index.blocks_of("big")[GPU] == 80 - 6
    # A chain's last blocks count as its oldest: cut from its end, its prefix still found.
    assert matched(index, big) == {"big": 74}


def test_a_shared_block_goes_for_every_holder_and_a_new_announcement_files_it_again(
    state: RedisState,
) -> None:
    index = RedisPrefixIndex(state, max_entries=20)
    (shared,) = chains(1, 10, seed=6)
    index.add("a", GPU, NS, shared)
    index.add("b", Tier.CPU, NS, shared)
    index.add("c", GPU, NS, chains(1, 12, seed=7)[0])  # 22 > 20: 2 + 1 of the oldest go
    assert matched(index, shared) == {"a": 7, "b": 7}  # its last 3 blocks, for both holders
    gone = {(e, t): sorted(h) for e, t, _ns, h in index.take_forgotten()}
    assert gone == {("a", GPU): sorted(shared[7:]), ("b", Tier.CPU): sorted(shared[7:])}
    assert index.blocks_of("a")[GPU] == index.blocks_of("b")[Tier.CPU] == 7
    index.add("a", GPU, NS, shared)
    assert matched(index, shared)["a"] == 10


def test_maintenance_keeps_to_a_lowered_bound_biggest_namespace_first(state: RedisState) -> None:
    roomy = RedisPrefixIndex(state, max_entries=10_000)
    old, new = chains(6, 25, seed=8), chains(4, 25, seed=9)  # 150 entries there, 100 here
    for chain in old:
        roomy.add("a", GPU, OTHER, chain)
    for chain in new:
        roomy.add("a", GPU, NS, chain)
    tight = RedisPrefixIndex(state, max_entries=120)  # an operator lowered the bound
    for _ in range(20):
        tight.maintain(64)
    assert tight.memory().entries <= 120
    assert all(matched(tight, chain) == {"a": 25} for chain in new)  # the smaller namespace kept
    assert sum(matched(tight, chain, OTHER).get("a", 0) for chain in old) == 150 - (250 - 120 + 120 // 16)
    assert tight.total_blocks() == tight.memory().entries


def test_unbounded_keeps_no_recency_and_no_count(state: RedisState) -> None:
    index = RedisPrefixIndex(state)
    index.add("a", GPU, NS, chains(1, 50, seed=10)[0])
    assert index.memory().entry_cap == 0 and index.take_forgotten() == []
    assert (
        state.client.keys(f"{state.prefix}:*lru*") == [] and state.client.get(f"{state.prefix}:ixn") is None
    )
