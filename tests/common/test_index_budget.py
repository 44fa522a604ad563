"""The index's memory budget: the size model against CPython's real dicts, which entries go
first, and answers that stay correct (a forgotten block is a miss, never a wrong holder)."""

from __future__ import annotations

import random
import sys

import pytest

from kvbroker.common.index import SHARD_MASK, SHARDS, CompactPrefixIndex
from kvbroker.common.index_budget import (
    KEY_BYTES,
    batch_size,
    next_pow2,
    pick_forgotten,
    shard_bytes,
    shard_cap,
    table_bytes,
)
from kvbroker.common.model import Namespace, Tier

NS = Namespace("layout", "")
MIB = 1024 * 1024
KEY = b"k" * 32  # a fixed salt key: the same blocks land in the same shards every run


def _chain(rng: random.Random, n: int = 64) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def test_table_model_matches_real_dicts() -> None:
    d: dict[int, int] = {}
    rng = random.Random(1)
    seen = set()
    for _ in range(200_000):
        d[rng.getrandbits(64)] = 1
        size = sys.getsizeof(d)
        if size not in seen:  # the table just grew: the model must name this very size
            seen.add(size)
            slots = next(s for s in (1 << k for k in range(3, 24)) if table_bytes(s) == size)
            assert len(d) <= 2 * slots // 3
    assert len(seen) > 10


def test_a_churning_shard_never_outgrows_its_model() -> None:
    """Insert at the end, forget batches from the front, as the bounded index does."""
    for cap in (21, 170, 1_365, 5_000):
        d: dict[int, int] = {}
        rng = random.Random(cap)
        worst = 0
        for i in range(cap * 12):
            d[rng.getrandbits(64)] = 1
            if i % 7 == 0 and d:  # some matches move an entry to the end, as lookups do
                k = next(iter(d))
                d[k] = d.pop(k)
            if len(d) > cap:
                for k in list(d)[: batch_size(cap)]:
                    del d[k]
            worst = max(worst, sys.getsizeof(d) + len(d) * KEY_BYTES)
        assert worst <= shard_bytes(cap), cap
        assert sys.getsizeof(d) <= table_bytes(next_pow2(3 * cap))


@pytest.mark.parametrize("mib", [1, 3, 8, 64, 100, 1024])
def test_the_cap_fills_the_budget_and_no_more(mib: int) -> None:
    cap = shard_cap(mib * MIB, SHARDS)
    assert cap > 0
    assert SHARDS * shard_bytes(cap) <= mib * MIB
    # Honest about how much of the budget the steps of dict sizes leave unused.
    assert SHARDS * shard_bytes(cap) >= 0.6 * mib * MIB


def test_pick_forgotten_prefers_garbage_then_the_heaviest_engine_then_age() -> None:
    weights = {1: -1, 2: 10, 3: 500}  # 1: no live holder; 3: the engine with the most blocks
    candidates = [(100, 2), (101, 3), (102, 1), (103, 2), (104, 3)]
    assert pick_forgotten(candidates, 3, weights.__getitem__) == [102, 101, 104]
    assert pick_forgotten(candidates, 5, weights.__getitem__)[3:] == [100, 103]


def test_least_recently_matched_go_first() -> None:
    ix = CompactPrefixIndex(salt_key=KEY, memory_budget=1 * MIB)
    rng = random.Random(2)
    old, hot = _chain(rng), _chain(rng)
    ix.add("e", Tier.GPU, NS, old)
    ix.add("e", Tier.GPU, NS, hot)
    cap = ix.memory().entry_cap
    for _ in range(4 * cap // 1_000):
        ix.add("e", Tier.GPU, NS, _chain(rng, 1_000))
        assert ix.longest_prefixes(NS, hot) == [("e", Tier.GPU, 64)]  # matched: used now
    assert ix.longest_prefixes(NS, old) == []  # never matched again: forgotten
    mem = ix.memory()
    assert mem.forgotten > 0 and mem.entries <= cap
    assert ix.total_blocks() == mem.entries  # one holder: its count is the entries left
    assert mem.estimated_bytes <= mem.budget_bytes


def test_an_announced_block_counts_as_used() -> None:
    ix = CompactPrefixIndex(salt_key=KEY, memory_budget=1 * MIB)
    rng = random.Random(3)
    kept = _chain(rng)
    ix.add("a", Tier.GPU, NS, kept)
    for _ in range(4 * ix.memory().entry_cap // 1_000):
        ix.add("b", Tier.GPU, NS, _chain(rng, 1_000))
        ix.add("a", Tier.GPU, NS, kept)  # re-announced (the engine still caches it)
    assert ix.longest_prefixes(NS, kept) == [("a", Tier.GPU, 64)]


def test_the_engine_holding_the_most_loses_first() -> None:
    """Same age, two engines: the small engine's blocks outlive the big engine's."""
    ix = CompactPrefixIndex(salt_key=KEY, memory_budget=4 * MIB)
    rng = random.Random(4)
    small, big = [], []
    for _ in range(2_560):  # interleaved: in each shard they are equally old
        s, b = rng.getrandbits(64), rng.getrandbits(64)
        ix.add("small", Tier.GPU, NS, [s])
        ix.add("big", Tier.GPU, NS, [b])
        small.append(s)
        big.append(b)
    cap = ix.memory().entry_cap
    ix.add("big", Tier.GPU, NS, _chain(rng, cap - 2 * 2_560 + cap // 40))  # a little past the cap
    assert ix.memory().forgotten > 0
    small_left = sum(1 for h in small if ix.longest_prefixes(NS, [h]))
    big_left = sum(1 for h in big if ix.longest_prefixes(NS, [h]))
    lost_small, lost_big = 2_560 - small_left, 2_560 - big_left
    assert lost_big > 4 * max(1, lost_small), (lost_small, lost_big)
    assert ix.blocks_of("small")[Tier.GPU] == small_left


def test_blocks_of_a_dropped_engine_go_before_live_ones() -> None:
    ix = CompactPrefixIndex(salt_key=KEY, memory_budget=8 * MIB)  # candidates: the 36 oldest of each shard
    rng = random.Random(5)
    gone, live = [], []
    for _ in range(2_000):
        g, h = rng.getrandbits(64), rng.getrandbits(64)
        ix.add("gone", Tier.GPU, NS, [g])
        ix.add("live", Tier.GPU, NS, [h])
        gone.append(g)
        live.append(h)
    ix.drop_holder("gone")  # its entries stay as garbage until the sweep
    ix.add("other", Tier.GPU, NS, _chain(rng, ix.memory().entry_cap - 4_000 + 500))
    assert ix.memory().forgotten > 0
    live_left = sum(1 for h in live if ix.longest_prefixes(NS, [h]))
    assert live_left > 0.95 * len(live)


def test_answers_stay_correct_under_a_tight_budget() -> None:
    """Random announcements, removals, drops and lookups against a model of who holds what: every
    answer names a holder that announced the whole matched prefix, at most as long as the truth."""
    ix = CompactPrefixIndex(salt_key=KEY, memory_budget=256 * 1024)  # 8 entries a shard
    rng = random.Random(6)
    engines = [("e0", Tier.GPU), ("e0", Tier.CPU), ("e1", Tier.GPU), ("e2", Tier.GPU)]
    held: dict[tuple[str, Tier], set[int]] = {h: set() for h in engines}
    chains = [_chain(rng, 48) for _ in range(400)]  # 19,200 blocks, about 9x the cap
    checked = 0
    for step in range(6_000):
        op = rng.random()
        engine, tier = rng.choice(engines)
        chain = rng.choice(chains)
        if op < 0.45:
            part = chain[: rng.randint(1, len(chain))]
            ix.add(engine, tier, NS, part)
            held[(engine, tier)].update(part)
        elif op < 0.55:
            part = chain[rng.randint(0, len(chain) - 1) :]
            ix.remove(engine, tier, NS, part)
            held[(engine, tier)].difference_update(part)
        elif op < 0.555:
            ix.drop_holder(engine)
            for t in (Tier.GPU, Tier.CPU):
                if (engine, t) in held:
                    held[(engine, t)].clear()
        else:
            for holder, t, matched in ix.longest_prefixes(NS, chain):
                truth = held[(holder, t)]
                assert all(h in truth for h in chain[:matched]), (step, holder, t, matched)
                checked += 1
        if step % 50 == 0:
            ix.maintain(10_000)
    mem = ix.memory()
    assert mem.forgotten > 0 and checked > 500
    assert mem.entries <= mem.entry_cap
    # Per-holder counts never exceed what the holder really has.
    for (engine, tier), truth in held.items():
        assert ix.blocks_of(engine)[tier] <= len(truth)


def test_unbounded_by_default_and_a_budget_too_small_is_refused() -> None:
    ix = CompactPrefixIndex(salt_key=KEY)
    ix.add("e", Tier.GPU, NS, list(range(10_000)))
    assert ix.memory().budget_bytes == 0 and ix.memory().forgotten == 0 and ix.total_blocks() == 10_000
    with pytest.raises(ValueError, match="holds no entry"):
        CompactPrefixIndex(salt_key=KEY, memory_budget=1_000)


def test_shards_stay_under_their_cap() -> None:
    ix = CompactPrefixIndex(salt_key=KEY, memory_budget=2 * MIB)
    rng = random.Random(7)
    for _ in range(30):
        ix.add("e", Tier.GPU, NS, _chain(rng, 2_000))
    cap = ix.memory().entry_cap // SHARDS
    assert max(len(s) for s in ix._shards) <= cap
    assert all(k & SHARD_MASK == i for i, s in enumerate(ix._shards) for k in list(s)[:3])


def test_the_key_constant_and_the_estimate_against_tracemalloc() -> None:
    import tracemalloc

    assert (sys.getsizeof(1 << 63) + 15) // 16 * 16 == KEY_BYTES  # pymalloc: 16-byte size classes
    rng = random.Random(8)
    chains = [_chain(rng, 1_000) for _ in range(70)]  # made before tracing: only the index is traced
    tracemalloc.start()
    try:
        ix = CompactPrefixIndex(salt_key=KEY, memory_budget=2 * MIB)
        for chain in chains:  # 70,000 blocks, about 4x the cap
            ix.add("e", Tier.GPU, NS, chain)
        traced, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    mem = ix.memory()
    assert mem.forgotten > 0
    # tracemalloc counts 36 bytes a key where pymalloc takes 48: the estimate is the larger.
    assert 0.8 * mem.estimated_bytes <= traced <= mem.estimated_bytes <= 2 * MIB, (traced, mem)
