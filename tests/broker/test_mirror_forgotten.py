"""What a bounded index forgets reaches its mirrors (broker/observed.py): removals marked
`forgotten`, so a mirror keeps answering what the broker answers instead of naming holders the
broker forgot. In memory (--index-memory-mib) and on a real redis-server and Cluster
(--index-max-entries: forgotten on announcement and by maintenance). On a real broker process
with a mirror following it over gRPC: tests/broker/test_index_memory.py."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.core import BrokerCore
from kvbroker.broker.fleet.index import RedisPrefixIndex
from kvbroker.broker.mirror import mirror_engine_info
from kvbroker.clients.mirror import IndexMirror
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.clock import FakeClock
from tests.broker.helpers import redis_state

CHAIN = 32


def follow(core: BrokerCore, layout_id: str) -> tuple[IndexMirror, Any]:
    """A mirror of the layout as the Mirror stream builds it: a snapshot, then the changes."""
    sub = core.mirrors.subscribe(layout_id, lambda: None, max_pending=1 << 30)
    sub.restart()
    mirror = IndexMirror(layout_id)
    engines = [pb.MirrorEngine(engine=mirror_engine_info(e)) for e in core.mirror_engines(layout_id)]
    mirror.apply(pb.MirrorUpdate(reset=True, engines=engines))
    for step in core.index.export(layout_id, 4096):
        blocks = [
            pb.MirrorBlocks(engine_id=e, tenant=ns.tenant, tier=pb.Tier.ValueType(t), stored=hs)
            for e, t, ns, hs in step
        ]
        mirror.apply(pb.MirrorUpdate(blocks=blocks))
    mirror.apply(pb.MirrorUpdate(synced=True))
    return mirror, sub


def catch_up(mirror: IndexMirror, sub: Any) -> None:
    for update in sub.take():
        mirror.apply(update)
    assert not sub.overflowed


def same_answers(core: BrokerCore, mirror: IndexMirror, ns: Namespace, chains: list[list[int]]) -> int:
    """Every chain resolves alike on the broker and on the mirror; how many are still named."""
    named = 0
    for chain in chains:
        want = [(m.engine_id, int(m.tier), m.matched) for m in core.resolve(None, ns, chain).matches]
        got = mirror.resolve(ns.tenant, chain)
        assert got is not None
        assert [(m.engine_id, int(m.tier), m.matched_blocks) for m in got] == want
        named += bool(want)
    return named


def flood(
    core: BrokerCore, mirror: IndexMirror, sub: Any, ns: Namespace, n: int, seed: int
) -> list[list[int]]:
    """`n` chains announced, by two engines in turn; the mirror kept up after each."""
    rng = random.Random(seed)
    chains = []
    for i in range(n):
        chain = [rng.getrandbits(64) for _ in range(CHAIN)]
        core.update_inventory(core.registry.get("ab"[i % 2]), ns, int(Tier.GPU), chain, [])
        catch_up(mirror, sub)
        chains.append(chain)
    return chains


def engines(core: BrokerCore) -> Namespace:
    layout = core.register(engine_info("a"), 60_000).layout_id
    core.register(engine_info("b"), 60_000)
    return Namespace(layout, "")


def test_in_memory_what_the_budget_forgets_is_removed_from_mirrors() -> None:
    core = BrokerCore(BrokerConfig(index_memory_mib=1), clock=FakeClock())
    ns = engines(core)
    mirror, sub = follow(core, ns.layout_id)
    chains = flood(core, mirror, sub, ns, 3 * core.index.memory().entry_cap // CHAIN, seed=1)
    memory = core.index.memory()
    assert memory.forgotten > 0 and mirror.stats.forgotten == memory.forgotten
    assert mirror.total_blocks() == core.index.total_blocks() == memory.entries
    assert 0 < same_answers(core, mirror, ns, chains[::7]) < len(chains[::7])


@pytest.fixture(params=["redis", "redis-cluster"])
def server(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")


def test_in_the_store_what_announcements_and_maintenance_forget_is_removed_from_mirrors(server: Any) -> None:
    state = redis_state(server)
    core = BrokerCore(BrokerConfig(), clock=FakeClock(), index=RedisPrefixIndex(state, 600))
    ns = engines(core)
    mirror, sub = follow(core, ns.layout_id)
    chains = flood(core, mirror, sub, ns, 60, seed=2)  # 1,920 blocks against 600
    assert mirror.stats.forgotten == core.index.memory().forgotten > 1_000
    assert mirror.total_blocks() == core.index.total_blocks() <= 600
    assert 0 < same_answers(core, mirror, ns, chains) < len(chains)
    # An operator lowers the bound: maintenance forgets, and the mirrors of that broker hear it.
    tight = BrokerCore(BrokerConfig(), clock=FakeClock(), index=RedisPrefixIndex(state, 100))
    tight.register(engine_info("a"), 60_000)
    tight.register(engine_info("b"), 60_000)
    mirror, sub = follow(tight, ns.layout_id)
    for _ in range(10):
        tight.index.maintain(64)
        catch_up(mirror, sub)
    assert mirror.stats.forgotten > 0
    assert mirror.total_blocks() == tight.index.total_blocks() <= 100
    same_answers(tight, mirror, ns, chains)
