"""Index mirrors at the core level: a mirror fed the snapshot and the change stream
answers exactly what the broker's resolve answers, whatever happens while the
snapshot is being taken (property test), and the hub keeps order and bounds."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker.broker.core import BrokerCore
from kvbroker.broker.mirror import MirrorHub, MirrorSubscriber, live_updates, mirror_engine_info
from kvbroker.clients.mirror import IndexMirror
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from tests.broker.helpers import make_core

ENGINES = ["e0", "e1", "e2"]
TENANTS = ["", "t1"]
# Chains that share prefixes, so longest-prefix answers differ per holder.
BASE = list(range(100, 112))
CHAINS = [BASE, [*BASE[:5], 200, 201, 202], [300, 301, 302, 303]]


class Fleet:
    """Engines of one layout (and one of another layout) driven through the core."""

    def __init__(self) -> None:
        self.core, _, _ = make_core()
        self.sessions: dict[str, str] = {}
        self.layout_id = self.core.register(engine_info("probe"), 0).layout_id
        self.core.end_session(self.core.registry.get("probe").session_id)
        other = self.core.register(engine_info("other", model="other-model"), 0)
        self.other_ns = Namespace(other.layout_id, "")
        self.other = other
        # Start with stores everywhere, so that removes, clears and ends change answers.
        for e in ENGINES[:2]:
            self.do(("register", e))
            for tenant in TENANTS:
                for tier in (int(Tier.GPU), int(Tier.CPU)):
                    for chain in range(len(CHAINS)):
                        self.do(("store", e, tenant, tier, chain, 12 - 3 * chain))

    def ns(self, tenant: str) -> Namespace:
        return Namespace(self.layout_id, tenant)

    def do(self, op: tuple[Any, ...]) -> None:
        kind, e = op[0], op[1]
        rec = self.core.registry.find(e)
        if kind == "register":
            self.core.register(engine_info(e), 0)
            return
        if rec is None:
            return
        if kind == "end":
            self.core.end_session(rec.session_id)
        elif kind == "drain":
            self.core.drain(e)
        elif kind == "store":
            _, _, tenant, tier, chain, k = op
            self.core.update_inventory(rec, self.ns(tenant), tier, CHAINS[chain][:k], [])
        elif kind == "remove":
            _, _, tenant, tier, chain, k = op
            self.core.update_inventory(rec, self.ns(tenant), tier, [], CHAINS[chain][k : k + 2])
        elif kind == "clear":
            _, _, tenant, tier = op[:4]
            self.core.update_inventory(rec, self.ns(tenant), tier, [], [], clear_all=True)
        # The other layout's traffic must never reach this layout's mirror.
        self.core.update_inventory(self.other, self.other_ns, Tier.GPU, CHAINS[0][:3], [])


def ops() -> st.SearchStrategy[tuple[Any, ...]]:
    engine = st.sampled_from(ENGINES)
    tenant = st.sampled_from(TENANTS)
    tier = st.sampled_from([int(Tier.GPU), int(Tier.CPU)])
    chain = st.integers(0, len(CHAINS) - 1)
    k = st.integers(1, 12)
    return st.one_of(
        st.tuples(st.just("register"), engine),
        st.tuples(st.just("end"), engine),
        st.tuples(st.just("drain"), engine),
        st.tuples(st.just("store"), engine, tenant, tier, chain, k),
        st.tuples(st.just("remove"), engine, tenant, tier, chain, k),
        st.tuples(st.just("clear"), engine, tenant, tier),
    )


def broker_answer(core: BrokerCore, ns: Namespace, chain: list[int]) -> list[tuple[str, int, int]]:
    result = core.resolve(None, ns, chain)
    return [(m.engine_id, int(m.tier), m.matched) for m in result.matches]


def mirror_answer(mirror: IndexMirror, tenant: str, chain: list[int]) -> list[tuple[str, int, int]]:
    matches = mirror.resolve(tenant, chain)
    assert matches is not None, "mirror is not synced"
    return [(m.engine_id, int(m.tier), m.matched_blocks) for m in matches]


def subscribe_and_snapshot(
    fleet: Fleet, during: list[tuple[Any, ...]], chunk: int
) -> tuple[IndexMirror, Any]:
    """What the servicer does, with `during` applied between snapshot steps."""
    core = fleet.core
    sub = core.mirrors.subscribe(fleet.layout_id, lambda: None)
    mirror = IndexMirror(fleet.layout_id)
    sub.restart()
    mirror.apply(
        pb.MirrorUpdate(
            reset=True,
            engines=[
                pb.MirrorEngine(engine=mirror_engine_info(e)) for e in core.mirror_engines(fleet.layout_id)
            ],
        )
    )
    pending = list(during)
    for step in core.index.export(fleet.layout_id, chunk):
        mirror.apply(
            pb.MirrorUpdate(
                blocks=[
                    pb.MirrorBlocks(engine_id=e, tenant=ns.tenant, tier=pb.Tier.ValueType(t), stored=hs)
                    for e, t, ns, hs in step
                ]
            )
        )
        if pending:
            fleet.do(pending.pop(0))
    for op in pending:
        fleet.do(op)
    mirror.apply(pb.MirrorUpdate(synced=True))
    return mirror, sub


def drain_into(mirror: IndexMirror, sub: Any) -> None:
    for update in sub.take():
        mirror.apply(update)


@settings(max_examples=150, deadline=None)
@given(
    before=st.lists(ops(), max_size=25),
    during=st.lists(ops(), max_size=10),
    after=st.lists(ops(), max_size=25),
    chunk=st.integers(1, 8),
)
def test_mirror_answers_what_the_broker_answers(
    before: list[tuple[Any, ...]], during: list[tuple[Any, ...]], after: list[tuple[Any, ...]], chunk: int
) -> None:
    fleet = Fleet()
    for op in before:
        fleet.do(op)
    mirror, sub = subscribe_and_snapshot(fleet, during, chunk)
    for i, op in enumerate(after):
        fleet.do(op)
        if i % 3 == 0:  # delivery in irregular batches
            drain_into(mirror, sub)
    drain_into(mirror, sub)
    assert not sub.overflowed
    for tenant in TENANTS:
        for chain in CHAINS:
            assert mirror_answer(mirror, tenant, chain) == broker_answer(fleet.core, fleet.ns(tenant), chain)


def test_unsynced_mirror_gives_no_answer() -> None:
    mirror = IndexMirror("layout")
    assert mirror.resolve("", [1, 2]) is None
    mirror.apply(pb.MirrorUpdate(reset=True))
    assert mirror.resolve("", [1, 2]) is None
    mirror.apply(pb.MirrorUpdate(synced=True))
    assert mirror.resolve("", [1, 2]) == []
    mirror.mark_unsynced()
    assert mirror.resolve("", [1, 2]) is None


def test_engine_back_with_new_blocks_keeps_order() -> None:
    """gone, then registered again, then stored: the old blocks must not come back."""
    hub = MirrorHub()
    sub = hub.subscribe("L", lambda: None)
    ns = Namespace("L", "")
    info = engine_info("e0")
    hub.engine("L", info)
    hub.blocks("e0", ns, Tier.GPU, stored=[1, 2, 3])
    hub.engine("L", None, "e0")
    hub.engine("L", info)
    hub.blocks("e0", ns, Tier.GPU, stored=[1])
    mirror = IndexMirror("L")
    mirror.apply(pb.MirrorUpdate(reset=True, synced=True))
    updates = sub.take()
    assert len(updates) == 2, "an engine change after blocks must start a new message"
    for u in updates:
        mirror.apply(u)
    assert mirror_answer(mirror, "", [1, 2, 3]) == [("e0", int(Tier.GPU), 1)]


def test_subscriber_that_falls_behind_is_resynced_not_cut_off() -> None:
    hub = MirrorHub()
    woken: list[int] = []
    # Bytes: 6 hashes are 6 * 8 + 64 = 112 bytes; two such changes pass 200.
    sub = hub.subscribe("L", lambda: woken.append(1), max_pending=200)
    ns = Namespace("L", "")
    hub.blocks("e0", ns, Tier.GPU, stored=list(range(6)))
    assert not sub.overflowed
    hub.blocks("e0", ns, Tier.GPU, stored=list(range(6, 12)))
    assert sub.overflowed and sub.take() == []
    hub.blocks("e0", ns, Tier.GPU, stored=[99])  # ignored until the resync
    assert sub.take() == []
    sub.restart()
    assert not sub.overflowed
    hub.blocks("e0", ns, Tier.GPU, stored=[7])
    assert [list(b.stored) for u in sub.take() for b in u.blocks] == [[7]]
    assert woken


def test_engine_changes_count_their_bytes_toward_the_limit() -> None:
    """An engine change costs its whole EngineInfo, not one item: large labels overflow soon."""
    hub = MirrorHub()
    sub = hub.subscribe("L", lambda: None, max_pending=1 << 20)
    info = engine_info("big")
    info.labels["blob"] = "x" * (300 << 10)
    for _ in range(3):
        hub.engine("L", info)
    assert not sub.overflowed and len(sub.take()) == 1
    for _ in range(4):  # 4 * 300 KiB > 1 MiB: dropped, and a resync is due
        hub.engine("L", info)
    assert sub.overflowed and sub.take() == [] and sub.pending == 0


def test_other_layouts_and_unwatched_layouts_cost_nothing() -> None:
    hub = MirrorHub()
    sub = hub.subscribe("L", lambda: None)
    hub.blocks("e0", Namespace("M", ""), Tier.GPU, stored=[1])
    hub.engine("M", engine_info("x"))
    assert sub.take() == []
    assert not hub.watching("M")
    hub.unsubscribe(sub)
    assert hub.subscriber_count() == 0


def test_mirror_engine_info_drops_nixl_blobs() -> None:
    info = engine_info("e0")
    info.ranks[0].tiers[0].regions.add(layer=0, base_addr=1, block_stride=2, block_bytes=2)
    info.ranks[0].tiers[0].digest_regions.add(layer=0, base_addr=9, block_stride=8, block_bytes=8)
    info.ranks[0].tiers[0].digest_table.regions.add(layer=0, base_addr=17, block_stride=8, block_bytes=8)
    slim = mirror_engine_info(info)
    assert slim.ranks[0].agent_metadata == b"" and not slim.ranks[0].tiers[0].regions
    assert not slim.ranks[0].tiers[0].digest_regions, "addresses are for readers holding a lease"
    assert not slim.ranks[0].tiers[0].HasField("digest_table")
    assert slim.ranks[0].end_layer == info.ranks[0].end_layer and slim.layout == info.layout
    assert info.ranks[0].agent_metadata == b"meta", "the original must not change"


async def test_a_stream_cancelled_as_a_change_arrives_ends() -> None:
    """The Mirror stream's loop ends on a cancel that lands in the same turn as a wake-up (a
    shutdown or a client gone while changes flow); Python 3.11's wait_for lost that cancel and the
    loop went on waiting for the next change."""
    ready = asyncio.Event()
    sub = MirrorSubscriber("L", ready.set)

    async def consume() -> None:
        async for _update in live_updates(sub, ready, keepalive_s=30.0):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)  # waiting for a change
    ready.set()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=2.0)
    if not done:  # let the loop go before failing
        sub.closed = "test over"
        ready.set()
        await asyncio.wait([task], timeout=2.0)
    assert done and task.cancelled()
