"""An engine's index changes applied in order, and those the shared store could not take kept for later.

An engine announces what it stores and removes on its session stream, once:
nothing in the protocol repeats an announcement. With ``--state``, a store that
does not answer (paused, failing over, a hung Cluster node) used to turn each
announcement into an error on the session and the change was lost, so the
shared index missed blocks the engine held, or kept naming blocks it had
dropped, until the engine registered again. Instead the replica keeps the
changes of each of its sessions, in the order the engine sent them, and applies
them once the store answers (``flush``, at every expiry pass, and before any
later change of the same session, which therefore waits behind them). Applying
a change twice is harmless (adds and removes are idempotent; a lease already
revoked for a removal is not revoked again), so a change leaves the queue only
once it went through whole.

Where the session is when its changes are applied decides what is applied:

- still served here (resumed here included): everything, in order;
- resumed on another replica meanwhile: only the removals and clears. The
  engine re-announced what it holds through that replica; an add kept here
  could name a block it dropped since (a stale holder), a removal at worst
  hides a block it stored again (a miss, never a wrong answer);
- ended: nothing (its blocks left the index with it).

Bounded: at most ``MAX_HASHES`` hashes wait per session. A session over it
keeps only its removals and clears (adds are what the engine re-announces) or,
if those alone are over, one clear of each tier it touched; and its stream is
closed (UNAVAILABLE), so the engine registers again and re-announces everything
it holds. Nothing it dropped is left in the index.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvbroker.broker.errors import Unavailable
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.model import Namespace, Tier

MAX_HASHES = 262_144  # per session: a few MiB of Python ints, minutes of announcements at a high rate


@dataclass(frozen=True, slots=True)
class IndexChange:
    """One inventory message as the core applies it."""

    namespace: Namespace
    tier: Tier
    stored: Sequence[int]
    removed: Sequence[int]
    clear_all: bool

    @property
    def size(self) -> int:
        return len(self.stored) + len(self.removed) + 1

    def without_adds(self) -> IndexChange | None:
        if not self.removed and not self.clear_all:
            return None
        return IndexChange(self.namespace, self.tier, (), self.removed, self.clear_all)


def _clears(changes: Iterable[IndexChange]) -> list[IndexChange]:
    """One clear of each (layout, tier) the changes touched."""
    seen = {(c.namespace.layout_id, c.tier): c.namespace for c in changes}
    return [IndexChange(ns, tier, (), (), True) for (_, tier), ns in seen.items()]


class Index(Protocol):
    def add(self, engine_id: str, tier: Tier, namespace: Namespace, hashes: Sequence[int]) -> int: ...

    def remove(self, engine_id: str, tier: Tier, namespace: Namespace, hashes: Sequence[int]) -> int: ...

    def clear_tier(self, engine_id: str, layout_id: str, tier: Tier) -> int: ...


# Revokes the engine's leases on blocks about to go: (holder, namespace or all, tier, hashes or all).
Supersede = Callable[[EngineRecord, Namespace | None, Tier, Sequence[int] | None], None]


class Notifier(Protocol):
    def close_session(self, session_id: str, code: str, message: str) -> None: ...


class Sessions(Protocol):
    """What the backlog asks the registry: a session's record now, and whether it is served here."""

    def find(self, engine_id: str) -> EngineRecord | None: ...

    def owns(self, rec: EngineRecord) -> bool: ...


class InventoryBacklog:
    """Applies each session's index changes in order, keeping those the store cannot take now.

    Each change goes to `index` (Unavailable: not now), leases on the blocks it removes revoked
    first (`supersede`: watchers see why before the blocks go); `registry` says where a session is
    now; `notifier` closes a session whose queue overflowed."""

    def __init__(
        self,
        index: Index,
        supersede: Supersede,
        registry: Sessions,
        notifier: Notifier,
        max_hashes: int = MAX_HASHES,
    ) -> None:
        self._index = index
        self._supersede = supersede
        self._registry = registry
        self._notifier = notifier
        self.max_hashes = max_hashes
        self._queues: dict[str, tuple[EngineRecord, deque[IndexChange]]] = {}
        self._sizes: dict[str, int] = {}
        self.deferred_total = 0  # changes ever kept here
        self.overflowed_total = 0  # sessions closed because their queue was full

    def __len__(self) -> int:
        return sum(len(q) for _, q in self._queues.values())

    def update(self, rec: EngineRecord, change: IndexChange) -> None:
        """Apply `change` now if the session has nothing waiting and the store takes it, else keep
        it behind the session's others."""
        if rec.session_id in self._queues and not self._flush_one(rec):
            self._defer(rec, change)
            return
        try:
            self._apply(rec, change)
        except Unavailable:
            self._defer(rec, change)

    def flush(self) -> None:
        """Apply what waits, session by session, until the store refuses something (the rest waits)."""
        for old in [rec for rec, _ in self._queues.values()]:
            try:
                rec, here = self._locate(old)
            except Unavailable:
                return
            if rec is None:
                self.drop(old.session_id)
                continue
            if not here:
                self._keep_removals(old.session_id)
            if not self._flush_one(rec):
                return
            if not here:
                self.drop(old.session_id)

    def _apply(self, rec: EngineRecord, c: IndexChange) -> None:
        if c.clear_all:
            self._supersede(rec, None, c.tier, None)
            self._index.clear_tier(rec.engine_id, c.namespace.layout_id, c.tier)
        if c.removed:
            self._supersede(rec, c.namespace, c.tier, c.removed)
            self._index.remove(rec.engine_id, c.tier, c.namespace, c.removed)
        if c.stored:
            self._index.add(rec.engine_id, c.tier, c.namespace, c.stored)

    def _locate(self, rec: EngineRecord) -> tuple[EngineRecord | None, bool]:
        """The session's record now (None: it ended) and whether this replica serves it."""
        now = self._registry.find(rec.engine_id)
        if now is None or now.session_id != rec.session_id:
            return None, False
        return now, self._registry.owns(now)

    def drop(self, session_id: str) -> None:
        """The session ended: its blocks left the index with it, and its changes with them."""
        self._queues.pop(session_id, None)
        self._sizes.pop(session_id, None)

    def _flush_one(self, rec: EngineRecord) -> bool:
        entry = self._queues.get(rec.session_id)
        if entry is None:
            return True
        queue = entry[1]
        while queue:
            try:
                self._apply(rec, queue[0])
            except Unavailable:
                return False
            self._sizes[rec.session_id] -= queue.popleft().size
        self.drop(rec.session_id)
        return True

    def _keep_removals(self, session_id: str) -> None:
        rec, queue = self._queues[session_id]
        kept = [c for c in (change.without_adds() for change in queue) if c is not None]
        self._queues[session_id] = (rec, deque(kept))
        self._sizes[session_id] = sum(c.size for c in kept)

    def _defer(self, rec: EngineRecord, change: IndexChange) -> None:
        entry = self._queues.get(rec.session_id)
        if entry is None:
            entry = self._queues[rec.session_id] = (rec, deque())
        entry[1].append(change)
        size = self._sizes[rec.session_id] = self._sizes.get(rec.session_id, 0) + change.size
        self.deferred_total += 1
        if size <= self.max_hashes:
            return
        self.overflowed_total += 1
        self._keep_removals(rec.session_id)
        if self._sizes[rec.session_id] > self.max_hashes:
            clears = _clears(entry[1])
            self._queues[rec.session_id] = (rec, deque(clears))
            self._sizes[rec.session_id] = len(clears)
        # Its engine registers again and re-announces what it holds: the adds dropped here.
        self._notifier.close_session(rec.session_id, "UNAVAILABLE", "index changes lost: register again")
