"""InventoryBacklog with a fake index that refuses on demand and a fake registry: changes applied in
order (leases on removed blocks revoked first); a session resumed on another replica gets only its
removals applied, one that ended nothing; a session over the bound keeps its removals (or clears)
and is closed. (The real store: tests/broker/fleet/test_index_backlog.py and
tests/process/test_hung_store.py.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbroker.broker.errors import Unavailable
from kvbroker.broker.inventory_backlog import IndexChange, InventoryBacklog
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb

NS = Namespace("layout", "")


def _rec(session_id: str) -> EngineRecord:
    return EngineRecord(session_id, session_id, pb.EngineInfo(), "layout", 10.0, 0.0, 1)


def _change(stored: tuple[int, ...] = (), removed: tuple[int, ...] = (), clear: bool = False) -> IndexChange:
    return IndexChange(NS, Tier.GPU, stored, removed, clear)


class _Store:
    """The index and the lease revocations, all refused while `away`; `ops` lists what went through
    as (engine, op, hashes)."""

    def __init__(self) -> None:
        self.away = False
        self.ops: list[tuple[Any, ...]] = []

    def _write(self, *op: Any) -> int:
        if self.away:
            raise Unavailable("store away")
        self.ops.append(op)
        return 0

    def add(self, engine_id: str, tier: Tier, ns: Namespace, hashes: Sequence[int]) -> int:
        return self._write(engine_id, "add", tuple(hashes))

    def remove(self, engine_id: str, tier: Tier, ns: Namespace, hashes: Sequence[int]) -> int:
        return self._write(engine_id, "remove", tuple(hashes))

    def clear_tier(self, engine_id: str, layout_id: str, tier: Tier) -> int:
        return self._write(engine_id, "clear", ())

    def supersede(
        self, rec: EngineRecord, ns: Namespace | None, tier: Tier, gone: Sequence[int] | None
    ) -> None:
        self._write(rec.engine_id, "revoke", tuple(gone or ()))

    def changes(self) -> list[tuple[Any, ...]]:
        """The index writes only (revocations left out)."""
        return [op for op in self.ops if op[1] != "revoke"]


class _Registry:
    """Sessions by engine id, and which of them this replica serves."""

    def __init__(self, *recs: EngineRecord) -> None:
        self.recs = {r.engine_id: r for r in recs}
        self.here = {r.session_id for r in recs}

    def find(self, engine_id: str) -> EngineRecord | None:
        return self.recs.get(engine_id)

    def owns(self, rec: EngineRecord) -> bool:
        return rec.session_id in self.here


class _Notifier:
    def __init__(self) -> None:
        self.closed: list[str] = []

    def close_session(self, session_id: str, code: str, message: str) -> None:
        self.closed.append(session_id)


def _backlog(store: _Store, registry: _Registry, notifier: _Notifier, **kw: Any) -> InventoryBacklog:
    return InventoryBacklog(store, store.supersede, registry, notifier, **kw)


def test_changes_wait_in_order_and_a_later_one_waits_behind_them() -> None:
    a = _rec("a")
    store, notifier = _Store(), _Notifier()
    backlog = _backlog(store, _Registry(a), notifier)
    backlog.update(a, _change((1,)))
    store.away = True
    backlog.update(a, _change((2,), (1,)))
    backlog.update(a, _change((3,)))
    backlog.flush()
    assert len(backlog) == 2 and store.ops == [("a", "add", (1,))]
    store.away = False
    backlog.update(a, _change((4,)))  # the two kept go first
    assert store.ops == [
        ("a", "add", (1,)),
        ("a", "revoke", (1,)),  # leases on a removed block end before it leaves the index
        ("a", "remove", (1,)),
        ("a", "add", (2,)),
        ("a", "add", (3,)),
        ("a", "add", (4,)),
    ]
    assert len(backlog) == 0 and not notifier.closed


def test_a_session_resumed_elsewhere_gets_its_removals_and_one_that_ended_nothing() -> None:
    a, b = _rec("a"), _rec("b")
    registry = _Registry(a, b)
    store = _Store()
    backlog = _backlog(store, registry, _Notifier())
    store.away = True
    backlog.update(a, _change((1,), (2,)))
    backlog.update(a, _change(clear=True))
    backlog.update(b, _change((5,)))
    registry.here.discard("a")  # a resumed on another replica: it re-announced there
    del registry.recs["b"]  # b ended: its blocks left with it
    store.away = False
    backlog.flush()
    assert store.changes() == [("a", "remove", (2,)), ("a", "clear", ())]
    assert len(backlog) == 0


def test_a_session_over_the_bound_keeps_its_removals_and_is_closed() -> None:
    a = _rec("a")
    store, notifier = _Store(), _Notifier()
    backlog = _backlog(store, _Registry(a), notifier, max_hashes=6)
    store.away = True
    backlog.update(a, _change((1, 2), (3,)))  # 4 of 6 (a change counts one more than its hashes)
    backlog.update(a, _change((4, 5)))  # 7 > 6: adds dropped, the engine re-announces them
    assert notifier.closed == ["a"] and backlog.overflowed_total == 1
    store.away = False
    backlog.flush()
    assert store.changes() == [("a", "remove", (3,))]


def test_removals_over_the_bound_become_a_clear_of_each_tier() -> None:
    a = _rec("a")
    store, notifier = _Store(), _Notifier()
    backlog = _backlog(store, _Registry(a), notifier, max_hashes=4)
    store.away = True
    backlog.update(a, _change((), (1, 2)))
    backlog.update(a, _change((), (3, 4)))
    assert notifier.closed == ["a"]
    store.away = False
    backlog.flush()
    assert store.changes() == [("a", "clear", ())]  # nothing it dropped stays in the index
