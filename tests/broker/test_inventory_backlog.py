"""InventoryBacklog with a fake store that refuses on demand: order kept, a bound that ends the
session, and the queue of a session that ended or moved dropped. (The real store:
tests/broker/fleet/test_index_backlog.py.)"""

from __future__ import annotations

from kvbroker.broker.errors import Unavailable
from kvbroker.broker.inventory_backlog import IndexChange, InventoryBacklog
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb

NS = Namespace("layout", "")


def _rec(session_id: str) -> EngineRecord:
    return EngineRecord("e-" + session_id, session_id, pb.EngineInfo(), "layout", 10.0, 0.0, 1)


def _change(*stored: int) -> IndexChange:
    return IndexChange(NS, Tier.GPU, stored, (), False)


class _Store:
    def __init__(self) -> None:
        self.away = False
        self.applied: list[tuple[str, tuple[int, ...]]] = []

    def apply(self, rec: EngineRecord, change: IndexChange) -> None:
        if self.away:
            raise Unavailable("store away")
        self.applied.append((rec.session_id, tuple(change.stored)))


def test_changes_wait_in_order_and_a_later_one_waits_behind_them() -> None:
    store, lost = _Store(), []
    backlog = InventoryBacklog(store.apply, lambda rec: True, lost.append)
    a = _rec("a")
    backlog.update(a, _change(1))
    store.away = True
    backlog.update(a, _change(2))
    backlog.update(a, _change(3))
    backlog.flush()
    assert len(backlog) == 2 and store.applied == [("a", (1,))]
    store.away = False
    backlog.update(a, _change(4))  # the two kept go first
    assert store.applied == [("a", (1,)), ("a", (2,)), ("a", (3,)), ("a", (4,))]
    assert len(backlog) == 0 and not lost


def test_a_session_over_the_bound_is_ended_and_its_queue_dropped() -> None:
    store, lost = _Store(), []
    backlog = InventoryBacklog(store.apply, lambda rec: True, lost.append, max_hashes=5)
    a, b = _rec("a"), _rec("b")
    store.away = True
    backlog.update(a, _change(1, 2))  # 3 of 5 (a change counts one more than its hashes)
    backlog.update(b, _change(7))
    backlog.update(a, _change(3, 4))  # 6 > 5
    assert lost == [a] and backlog.overflowed_total == 1
    store.away = False
    backlog.flush()
    assert store.applied == [("b", (7,))]  # a's changes are gone; its engine re-announces


def test_the_queue_of_a_session_that_ended_or_moved_is_not_applied() -> None:
    store = _Store()
    here = {"a", "b"}
    backlog = InventoryBacklog(store.apply, lambda rec: rec.session_id in here, lambda rec: None)
    a, b = _rec("a"), _rec("b")
    store.away = True
    backlog.update(a, _change(1))
    backlog.update(b, _change(2))
    backlog.drop("a")  # ended here
    here.discard("b")  # moved to another replica
    store.away = False
    backlog.flush()
    assert store.applied == [] and len(backlog) == 0
