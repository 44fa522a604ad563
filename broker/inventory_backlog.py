"""Index changes an engine announced while the shared store did not answer, kept to apply once it does.

An engine announces what it stores and removes on its session stream, once:
nothing in the protocol repeats an announcement. With ``--state``, a store that
does not answer (paused, failing over, a hung Cluster node) used to turn each
announcement into an error on the session and the change was lost, so the
shared index missed blocks the engine held, or kept naming blocks it had
dropped, until the engine registered again. Instead the replica keeps the
changes of each of its sessions, in the order the engine sent them, and applies
them once the store answers (``BrokerCore.apply_backlog``, at every expiry
pass, and before any later change of the same session, which therefore waits
behind them). Applying a change twice is harmless (adds and removes are
idempotent; a lease already revoked for a removal is not revoked again), so a
change is dropped from the queue only once it went through whole.

Bounded: at most ``MAX_HASHES`` block hashes wait per session. A session that
would exceed it has lost changes for good; the broker ends that session
(UNAVAILABLE), so its engine registers again and re-announces everything it
holds, which rebuilds its part of the index from scratch. A session that ends
drops its queue (its blocks leave the index with it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


class InventoryBacklog:
    """Applies each session's index changes in order, keeping those the store cannot take now.

    `apply(rec, change)` writes one change (Unavailable: not now); `alive(rec)` says whether the
    session is still this replica's; `lost(rec)` ends a session whose changes overflowed."""

    def __init__(
        self,
        apply: Callable[[EngineRecord, IndexChange], None],
        alive: Callable[[EngineRecord], bool],
        lost: Callable[[EngineRecord], None],
        max_hashes: int = MAX_HASHES,
    ) -> None:
        self._apply = apply
        self._alive = alive
        self._lost = lost
        self.max_hashes = max_hashes
        self._queues: dict[str, tuple[EngineRecord, deque[IndexChange]]] = {}
        self._sizes: dict[str, int] = {}
        self.deferred_total = 0  # changes ever kept here
        self.overflowed_total = 0  # sessions ended because their queue was full

    def __len__(self) -> int:
        return sum(len(q) for _, q in self._queues.values())

    def update(self, rec: EngineRecord, change: IndexChange) -> None:
        """Apply `change` now if the session has nothing waiting and the store takes it, else keep
        it behind the session's others (applied by `flush`)."""
        if rec.session_id in self._queues and not self._flush_one(rec):
            self._defer(rec, change)
            return
        try:
            self._apply(rec, change)
        except Unavailable:
            self._defer(rec, change)

    def flush(self) -> None:
        """Apply what waits, session by session, until the store refuses one (the rest waits)."""
        for rec in [rec for rec, _ in self._queues.values()]:
            try:
                alive = self._alive(rec)
            except Unavailable:
                return
            if not alive:
                self.drop(rec.session_id)
            elif not self._flush_one(rec):
                return

    def drop(self, session_id: str) -> None:
        """The session ended: its blocks leave the index with it, and its changes with them."""
        self._queues.pop(session_id, None)
        self._sizes.pop(session_id, None)

    def _flush_one(self, rec: EngineRecord) -> bool:
        entry = self._queues.get(rec.session_id)
        while entry is not None:
            queue = entry[1]
            try:
                self._apply(rec, queue[0])
            except Unavailable:
                return False
            self._sizes[rec.session_id] -= queue.popleft().size
            if not queue:
                self.drop(rec.session_id)
                entry = None
        return True

    def _defer(self, rec: EngineRecord, change: IndexChange) -> None:
        size = self._sizes.get(rec.session_id, 0) + change.size
        if size > self.max_hashes:
            self.overflowed_total += 1
            self.drop(rec.session_id)
            self._lost(rec)
            return
        entry = self._queues.get(rec.session_id)
        if entry is None:
            entry = self._queues[rec.session_id] = (rec, deque())
        entry[1].append(change)
        self._sizes[rec.session_id] = size
        self.deferred_total += 1
