"""InventoryBacklog with a fake store that refuses on demand and a fake registry: order kept; a
session resumed on another replica gets only its removals applied, one that ended nothing; a
session over the bound keeps its removals (or clears) and is closed. (The real store:
tests/broker/fleet/test_index_backlog.py and tests/process/test_hung_store.py.)"""

from __future__ import annotations

from typing import Any

from kvbroker.broker.errors import Unavailable
from kvbroker.broker.inventory_backlog import IndexChange, InventoryBacklog
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb

NS = Namespace("layout", "")


def _rec(session_id: str) -> EngineRecord:
    return EngineRecord("e-" + session_id, session_id, pb.EngineInfo(), "layout", 10.0, 0.0, 1)


def _change(stored: tuple[int, ...] = (), removed: tuple[int, ...] = (), clear: bool = False) -> IndexChange:
    return IndexChange(NS, Tier.GPU, stored, removed, clear)


class _Store:
    def __init__(self) -> None:
        self.away = False
        self.applied: list[tuple[str, tuple[int, ...], tuple[int, ...], bool]] = []

    def apply(self, rec: EngineRecord, c: IndexChange) -> None:
        if self.away:
            raise Unavailable("store away")
        self.applied.append((rec.session_id, tuple(c.stored), tuple(c.removed), c.clear_all))


class _Registry:
    """Sessions by engine id, and which of them this replica serves."""

    def __init__(self, *recs: EngineRecord) -> None:
        self.recs = {r.engine_id: r for r in recs}
        self.here = {r.session_id for r in recs}

    def find(self, engine_id: str) -> EngineRecord | None:
        return self.recs.get(engine_id)

    def owns(self, rec: EngineRecord) -> bool:
        return rec.session_id in self.here


def _backlog(store: _Store, registry: _Registry, lost: list[EngineRecord], **kw: Any) -> InventoryBacklog:
    return InventoryBacklog(store.apply, registry, lost.append, **kw)


def test_changes_wait_in_order_and_a_later_one_waits_behind_them() -> None:
    a = _rec("a")
    store, lost = _Store(), []
    backlog = _backlog(store, _Registry(a), lost)
    backlog.update(a, _change((1,)))
    store.away = True
    backlog.update(a, _change((2,), (1,)))
    backlog.update(a, _change((3,)))
    backlog.flush()
    assert len(backlog) == 2 and store.applied == [("a", (1,), (), False)]
    store.away = False
    backlog.update(a, _change((4,)))  # the two kept go first
    assert [x[1:3] for x in store.applied] == [((1,), ()), ((2,), (1,)), ((3,), ()), ((4,), ())]
    assert len(backlog) == 0 and not lost


def test_a_session_resumed_elsewhere_gets_its_removals_and_one_that_ended_nothing() -> None:
    a, b = _rec("a"), _rec("b")
    registry = _Registry(a, b)
    store = _Store()
    backlog = _backlog(store, registry, [])
    store.away = True
    backlog.update(a, _change((1,), (2,)))
    backlog.update(a, _change(clear=True))
    backlog.update(b, _change((5,)))
    registry.here.discard("a")  # a resumed on another replica: it re-announced there
    del registry.recs["e-b"]  # b ended: its blocks left with it
    store.away = False
    backlog.flush()
    assert store.applied == [("a", (), (2,), False), ("a", (), (), True)]
    assert len(backlog) == 0


def test_a_session_over_the_bound_keeps_its_removals_and_is_closed() -> None:
    a = _rec("a")
    store, lost = _Store(), []
    backlog = _backlog(store, _Registry(a), lost, max_hashes=6)
    store.away = True
    backlog.update(a, _change((1, 2), (3,)))  # 4 of 6 (a change counts one more than its hashes)
    backlog.update(a, _change((4, 5)))  # 7 > 6: adds dropped, the engine re-announces them
    assert lost == [a] and backlog.overflowed_total == 1
    store.away = False
    backlog.flush()
    assert store.applied == [("a", (), (3,), False)]


def test_removals_over_the_bound_become_a_clear_of_each_tier() -> None:
    a = _rec("a")
    store, lost = _Store(), []
    backlog = _backlog(store, _Registry(a), lost, max_hashes=4)
    store.away = True
    backlog.update(a, _change((), (1, 2)))
    backlog.update(a, _change((), (3, 4)))
    assert lost == [a]
    store.away = False
    backlog.flush()
    assert store.applied == [("a", (), (), True)]  # nothing it dropped stays in the index
