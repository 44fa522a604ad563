"""What an engine holds, per (layout_id, tenant, tier), and the changes the broker has not heard yet.

``InventoryMirror`` is the engine's own truth about its blocks. ``EngineSession``
records every ``announce_*`` in it, sends only the net difference a few
milliseconds later (a block stored and removed again before the flush costs
nothing), and rebuilds the broker's copy from it after every (re)registration.
Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TypeAlias

from kvbroker.v1 import broker_pb2 as pb

NamespaceLike: TypeAlias = pb.Namespace | tuple[str, str]
# (layout_id, tenant, tier)
InventoryKey: TypeAlias = tuple[str, str, int]

# Larger than any sane flush, smaller than any sane broker limit on hash lists.
DEFAULT_MAX_HASHES_PER_UPDATE = 4096


def namespace_key(namespace: NamespaceLike) -> tuple[str, str]:
    if isinstance(namespace, pb.Namespace):
        return (namespace.layout_id, namespace.tenant)
    layout_id, tenant = namespace
    return (layout_id, tenant)


@dataclasses.dataclass
class _PendingChanges:
    stored: set[int] = dataclasses.field(default_factory=set)
    removed: set[int] = dataclasses.field(default_factory=set)

    def size(self) -> int:
        return len(self.stored) + len(self.removed)


class InventoryMirror:
    """What this engine holds per (layout_id, tenant, tier), and the changes not yet sent.

    The mirror is the engine's own truth; the broker's copy is rebuilt from it
    after every (re)registration. The broker applies an update's ``clear_all``
    first (to the whole tier, every namespace), then removed, then stored;
    pending stored and removed sets stay disjoint.
    """

    def __init__(self) -> None:
        self._held: dict[InventoryKey, set[int]] = {}
        self._pending: dict[InventoryKey, _PendingChanges] = {}
        # tier -> a namespace to carry the tier's pending clear_all in
        self._tier_clears: dict[int, tuple[str, str]] = {}

    @property
    def pending_count(self) -> int:
        """Pending hashes, plus one per pending tier clear."""
        return sum(c.size() for c in self._pending.values()) + len(self._tier_clears)

    def _changes(self, key: InventoryKey) -> _PendingChanges:
        changes = self._pending.get(key)
        if changes is None:
            changes = self._pending[key] = _PendingChanges()
        return changes

    # Invariant: the broker's copy of a key is (held - pending.stored) | pending.removed
    # (counting from an empty tier when the tier has a pending clear), so every
    # change sends exactly the net difference, and nothing when it is undone
    # before the flush.

    def stored(self, key: InventoryKey, hashes: Iterable[int]) -> None:
        held = self._held.setdefault(key, set())
        changes = self._changes(key)
        for h in hashes:
            if h in held:
                continue  # already announced or about to be
            held.add(h)
            if h in changes.removed:
                changes.removed.discard(h)  # the broker never heard it was gone
            else:
                changes.stored.add(h)

    def removed(self, key: InventoryKey, hashes: Iterable[int]) -> None:
        held = self._held.get(key)
        if not held:
            return
        changes = self._changes(key)
        for h in hashes:
            if h not in held:
                continue  # never announced: nothing to take back
            held.discard(h)
            if h in changes.stored:
                changes.stored.discard(h)  # the broker never heard of it
            else:
                changes.removed.add(h)

    def clear(self, key: InventoryKey) -> None:
        """Forget one namespace on one tier (sent as removals: a clear_all would hit the whole tier)."""
        self.removed(key, list(self._held.get(key, ())))

    def clear_tier(self, tier: int) -> None:
        """Forget everything on ``tier``, in every namespace (sent as one clear_all)."""
        keys = self.keys(tier=tier)
        if not keys:
            return
        for key in keys:
            self._held.pop(key, None)
            self._pending.pop(key, None)
        self._tier_clears[tier] = (keys[0][0], keys[0][1])

    def adopt_layout(self, layout_id: str) -> None:
        """File what was recorded before registration (with an empty layout id) under ``layout_id``.

        Nothing under an empty layout id was ever sent, so its held set is the
        whole story.
        """
        for key in [k for k in self.keys() if not k[0]]:
            held = self._held.pop(key, set())
            self._pending.pop(key, None)
            self.stored((layout_id, key[1], key[2]), held)
        for tier, (clear_layout, tenant) in list(self._tier_clears.items()):
            if not clear_layout:
                self._tier_clears[tier] = (layout_id, tenant)

    def keys(self, tier: int | None = None) -> list[InventoryKey]:
        keys = set(self._held) | set(self._pending)
        return sorted(k for k in keys if tier is None or k[2] == tier)

    def held(self, key: InventoryKey) -> frozenset[int]:
        return frozenset(self._held.get(key, ()))

    def total_held(self) -> int:
        return sum(len(s) for s in self._held.values())

    def take_updates(self, max_hashes: int = DEFAULT_MAX_HASHES_PER_UPDATE) -> list[pb.InventoryUpdate]:
        """The pending changes as messages (at most ``max_hashes`` hashes each); clears them."""
        updates = [_clear_update(ns, tier) for tier, ns in sorted(self._tier_clears.items())]
        for key, changes in sorted(self._pending.items()):
            updates.extend(_chunked_updates(key, changes, max_hashes))
        self._pending.clear()
        self._tier_clears.clear()
        return updates

    def full_sync_updates(
        self, max_hashes: int = DEFAULT_MAX_HASHES_PER_UPDATE, clear: bool = True
    ) -> list[pb.InventoryUpdate]:
        """Messages that replace the broker's view with the whole mirror; clears pending changes.

        Each tier starts with a clear_all, so a broker that kept old state for
        this engine drops it first; without `clear` (a resumed session) they only
        add: a block the broker still names but we dropped is refused at its pin.
        """
        keys = [k for k in self.keys() if self._held.get(k)]
        tiers: dict[int, tuple[str, str]] = {}
        for layout_id, tenant, tier in keys:
            tiers.setdefault(tier, (layout_id, tenant))
        if not clear:  # only the tier clears the broker has not heard yet
            tiers = dict(self._tier_clears)
        updates = [_clear_update(ns, tier) for tier, ns in sorted(tiers.items())]
        for key in keys:
            gone = set() if clear or key not in self._pending else set(self._pending[key].removed)
            changes = _PendingChanges(stored=set(self._held[key]), removed=gone)
            updates.extend(_chunked_updates(key, changes, max_hashes))
        if not clear:  # removals the broker may not have heard, of keys we no longer hold at all
            for key, pending in self._pending.items():
                if key not in keys and pending.removed:
                    updates.extend(
                        _chunked_updates(key, _PendingChanges(removed=set(pending.removed)), max_hashes)
                    )
        self._pending.clear()
        self._tier_clears.clear()
        return updates


def _clear_update(namespace: tuple[str, str], tier: int) -> pb.InventoryUpdate:
    return pb.InventoryUpdate(
        namespace=pb.Namespace(layout_id=namespace[0], tenant=namespace[1]),
        tier=pb.Tier.ValueType(tier),
        clear_all=True,
    )


def _chunked_updates(
    key: InventoryKey, changes: _PendingChanges, max_hashes: int
) -> list[pb.InventoryUpdate]:
    layout_id, tenant, tier = key
    namespace = pb.Namespace(layout_id=layout_id, tenant=tenant)
    stored = sorted(changes.stored)
    removed = sorted(changes.removed)
    updates: list[pb.InventoryUpdate] = []
    while stored or removed:
        take_stored, stored = stored[:max_hashes], stored[max_hashes:]
        room = max_hashes - len(take_stored)
        take_removed, removed = removed[:room], removed[room:]
        updates.append(
            pb.InventoryUpdate(
                namespace=namespace, tier=pb.Tier.ValueType(tier), stored=take_stored, removed=take_removed
            )
        )
    return updates
