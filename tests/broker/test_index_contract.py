"""The PrefixIndex contract: every backend must pass these (in-memory, Redis, and a Redis Cluster)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvbroker.broker.fleet.index import RedisPrefixIndex
from kvbroker.common.index import CompactPrefixIndex, PrefixIndex
from kvbroker.common.model import Namespace, Tier
from tests.broker.helpers import redis_state

BACKENDS: dict[str, Callable[[pytest.FixtureRequest], PrefixIndex]] = {
    "compact-in-memory": lambda _: CompactPrefixIndex(),
    # A budget these tests never reach: matches and announcements reorder entries, answers must not change.
    "compact-bounded": lambda _: CompactPrefixIndex(memory_budget=8 * 1024 * 1024),
    # A real redis-server started by the tests (skipped, with the reason, where none can run).
    "redis": lambda request: RedisPrefixIndex(redis_state(request.getfixturevalue("redis_server"))),
    # A real 3-primary Redis Cluster started by the tests: each namespace's keys on one slot.
    "redis-cluster": lambda request: RedisPrefixIndex(redis_state(request.getfixturevalue("redis_cluster"))),
    # --index-max-entries never reached: recency upkeep (announcements, matches, removals, sweeps)
    # must not change answers. Past the bound: tests/broker/fleet/test_index_bound.py.
    "redis-bounded": lambda request: RedisPrefixIndex(
        redis_state(request.getfixturevalue("redis_server")), 10**6
    ),
    "redis-cluster-bounded": lambda request: RedisPrefixIndex(
        redis_state(request.getfixturevalue("redis_cluster")), 10**6
    ),
}
NS = Namespace("layout-a", "")
OTHER = Namespace("layout-a", "tenant-2")
_RND = random.Random(1)
H = [_RND.getrandbits(64) for _ in range(64)]


@pytest.fixture(params=list(BACKENDS))
def index(request: pytest.FixtureRequest) -> PrefixIndex:
    return BACKENDS[request.param](request)


def prefixes(index: PrefixIndex, hashes: list[int], ns: Namespace = NS) -> set[tuple[str, Tier, int]]:
    return set(index.longest_prefixes(ns, hashes))


def test_longest_prefix_per_holder_and_tier(index: PrefixIndex) -> None:
    assert index.add("a", Tier.GPU, NS, H[:10]) == 10
    index.add("a", Tier.CPU, NS, H[:30])
    index.add("b", Tier.GPU, NS, H[:64])
    index.add("c", Tier.GPU, NS, H[1:64])  # no block 0
    assert prefixes(index, H) == {("a", Tier.GPU, 10), ("a", Tier.CPU, 30), ("b", Tier.GPU, 64)}
    assert prefixes(index, H[:5]) == {("a", Tier.GPU, 5), ("a", Tier.CPU, 5), ("b", Tier.GPU, 5)}
    assert prefixes(index, []) == set()


def test_add_is_idempotent_and_counts(index: PrefixIndex) -> None:
    assert index.add("a", Tier.GPU, NS, H[:8]) == 8
    assert index.add("a", Tier.GPU, NS, H[:8]) == 0
    assert index.add("b", Tier.GPU, NS, H[:4]) == 4
    assert index.blocks_of("a") == {Tier.GPU: 8, Tier.CPU: 0}
    assert index.total_blocks() == 12
    assert index.remove("a", Tier.GPU, NS, [*H[:2], 12345]) == 2
    assert index.total_blocks() == 10
    assert prefixes(index, H) == {("b", Tier.GPU, 4)}  # a lost block 0
    assert index.remove("nobody", Tier.GPU, NS, H) == 0


def test_gap_in_the_middle_cuts_the_prefix(index: PrefixIndex) -> None:
    index.add("a", Tier.GPU, NS, H)
    index.remove("a", Tier.GPU, NS, [H[20]])
    assert prefixes(index, H) == {("a", Tier.GPU, 20)}


def test_namespaces_are_isolated(index: PrefixIndex) -> None:
    index.add("a", Tier.GPU, NS, H)
    assert prefixes(index, H, OTHER) == set()
    index.add("a", Tier.GPU, OTHER, H[:3])
    assert prefixes(index, H, OTHER) == {("a", Tier.GPU, 3)}
    assert index.namespace_count() == 2


def test_drop_holder_is_immediate_and_other_holders_survive(index: PrefixIndex) -> None:
    index.add("a", Tier.GPU, NS, H)
    index.add("a", Tier.CPU, NS, H)
    index.add("b", Tier.GPU, NS, H[:32])
    assert index.drop_holder("a", Tier.CPU) == 64
    assert prefixes(index, H) == {("a", Tier.GPU, 64), ("b", Tier.GPU, 32)}
    assert index.drop_holder("a") == 64
    assert prefixes(index, H) == {("b", Tier.GPU, 32)}
    assert index.total_blocks() == 32
    assert index.blocks_of("a") == {Tier.GPU: 0, Tier.CPU: 0}
    # The same engine id can come back and start from nothing.
    index.add("a", Tier.GPU, NS, H[:2])
    assert prefixes(index, H) == {("a", Tier.GPU, 2), ("b", Tier.GPU, 32)}


def test_background_maintenance_keeps_answers(index: PrefixIndex) -> None:
    rnd = random.Random(7)
    chains = {f"e{i}": [rnd.getrandbits(64) for _ in range(50)] for i in range(20)}
    for e, chain in chains.items():
        index.add(e, Tier.GPU, NS, chain)
        index.add("shared", Tier.CPU, NS, chain[:10])
    for i in range(0, 20, 2):
        index.drop_holder(f"e{i}")
    for _ in range(100):
        index.maintain(64)
    for i, (e, chain) in enumerate(chains.items()):
        want = {("shared", Tier.CPU, 10)} | ({(e, Tier.GPU, 50)} if i % 2 else set())
        assert prefixes(index, chain) == want
    # New holders after the sweep (recycled slots) do not inherit old blocks.
    index.add("new", Tier.GPU, NS, chains["e0"][:5])
    assert prefixes(index, chains["e0"]) == {("shared", Tier.CPU, 10), ("new", Tier.GPU, 5)}
    assert index.total_blocks() == 10 * 50 + 20 * 10 + 5


def test_matches_a_naive_model_under_random_operations(index: PrefixIndex) -> None:
    rnd = random.Random(3)
    pool = [rnd.getrandbits(64) for _ in range(40)]
    model: dict[tuple[str, Tier], set[int]] = {}
    for step in range(400):
        engine = rnd.choice("abcd")
        tier = rnd.choice([Tier.GPU, Tier.CPU])
        op = rnd.random()
        chunk = rnd.sample(pool, rnd.randint(1, 10))
        if op < 0.5:
            index.add(engine, tier, NS, chunk)
            model.setdefault((engine, tier), set()).update(chunk)
        elif op < 0.85:
            index.remove(engine, tier, NS, chunk)
            model.get((engine, tier), set()).difference_update(chunk)
        else:
            index.drop_holder(engine)
            for key in [k for k in model if k[0] == engine]:
                del model[key]
        if step % 7 == 0:
            index.maintain(16)
        chain = pool[: rnd.randint(1, 40)]
        want = set()
        for (e, t), blocks in model.items():
            n = 0
            while n < len(chain) and chain[n] in blocks:
                n += 1
            if n:
                want.add((e, t, n))
        assert prefixes(index, chain) == want
        assert index.total_blocks() == sum(len(b) for b in model.values())
