"""Which block lives in which CPU-tier slot: hash -> slot, LRU, pins per lease.

The scheduler side owns this directory; the worker's CpuTierBuffer only moves
bytes into the slots it is told to use. A slot is in one of three states:

- free;
- storing: a GPU -> CPU copy into it is in flight (not yet announced, never
  pinned, never evicted: the copy would land in a reused slot);
- ready: the bytes are there and announced to the broker as tier CPU.

Ready slots are evicted least recently used first, but never while a lease
pins them (a holder never reuses a block under an active lease). Pins arrive
on the broker session's thread and lease ends may too, so every method takes
one lock; each is a few dictionary operations.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

# (layout_id, tenant, wire hash): a block in its namespace.
BlockKey = tuple[str, str, int]


@dataclass
class _Slot:
    key: BlockKey
    ready: bool = False
    pins: int = 0


@dataclass
class Allocation:
    """Result of `CpuDirectory.allocate`: slots to copy into, and ready blocks evicted for them."""

    assigned: list[tuple[BlockKey, int]] = field(default_factory=list)
    evicted: list[BlockKey] = field(default_factory=list)
    skipped_present: int = 0
    no_room: int = 0


class CpuDirectory:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("the CPU tier directory needs at least one slot")
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._slots: dict[int, _Slot] = {}
        self._by_key: dict[BlockKey, int] = {}
        # Ready, unpinned slots in LRU order (oldest first): the eviction candidates.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[str, list[int]] = {}

    # ------------------------------------------------------------ storing

    def allocate(self, keys: Sequence[BlockKey]) -> Allocation:
        """Reserve a slot for each key not already in the tier, evicting LRU ready slots.

        Keys already present (storing or ready) are skipped and count as used
        (LRU touch). When every slot is storing or pinned, the remaining keys
        get no slot (`no_room`): the tier is best effort.
        """
        out = Allocation()
        with self._lock:
            for key in keys:
                slot = self._by_key.get(key)
                if slot is not None:
                    out.skipped_present += 1
                    self._touch(slot)
                    continue
                slot = self._take_slot(out.evicted)
                if slot is None:
                    out.no_room += 1
                    continue
                self._slots[slot] = _Slot(key)
                self._by_key[key] = slot
                out.assigned.append((key, slot))
        return out

    def mark_ready(self, slots: Sequence[int]) -> list[BlockKey]:
        """The copies into `slots` finished: they may now be announced, pinned, evicted."""
        ready: list[BlockKey] = []
        with self._lock:
            for slot in slots:
                entry = self._slots.get(slot)
                if entry is None or entry.ready:
                    continue
                entry.ready = True
                self._lru[slot] = None
                ready.append(entry.key)
        return ready

    def discard(self, slots: Sequence[int]) -> None:
        """The copies into `slots` failed: free them (they were never announced)."""
        with self._lock:
            for slot in slots:
                entry = self._slots.get(slot)
                if entry is None or entry.ready:
                    continue
                del self._slots[slot]
                del self._by_key[entry.key]
                self._free.append(slot)

    # ------------------------------------------------------------ pins

    def pin(self, lease_id: str, keys: Sequence[BlockKey]) -> list[int] | None:
        """Pin every key's slot for `lease_id`; None (nothing pinned) if any key is not ready here."""
        with self._lock:
            slots: list[int] = []
            for key in keys:
                slot = self._by_key.get(key)
                if slot is None or not self._slots[slot].ready:
                    return None
                slots.append(slot)
            if lease_id in self._pins:
                return None  # a lease is pinned once; a second command for it is a broker bug
            for slot in slots:
                entry = self._slots[slot]
                entry.pins += 1
                self._lru.pop(slot, None)
            self._pins[lease_id] = slots
            return slots

    def unpin(self, lease_id: str) -> bool:
        """The lease ended: its slots become evictable again (most recently used)."""
        with self._lock:
            slots = self._pins.pop(lease_id, None)
            if slots is None:
                return False
            for slot in slots:
                self._unpin_slot(slot)
            return True

    def unpin_all(self, keep_prefix: str = "") -> int:
        """The broker session was lost, and with it every lease. Pins whose id starts
        with `keep_prefix` (the engine's own restores, which no lease backs) stay."""
        with self._lock:
            leases = [p for p in self._pins if not (keep_prefix and p.startswith(keep_prefix))]
            for lease_id in leases:
                for slot in self._pins.pop(lease_id):
                    self._unpin_slot(slot)
            return len(leases)

    # ------------------------------------------------------------ queries

    def slot_of(self, key: BlockKey) -> int | None:
        with self._lock:
            return self._by_key.get(key)

    def ready_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many of `keys`, from the first, are ready here (a prefix this tier can restore)."""
        with self._lock:
            n = 0
            for key in keys:
                slot = self._by_key.get(key)
                if slot is None or not self._slots[slot].ready:
                    break
                n += 1
            return n

    def is_ready(self, key: BlockKey) -> bool:
        with self._lock:
            slot = self._by_key.get(key)
            return slot is not None and self._slots[slot].ready

    def pinned_slots(self) -> int:
        with self._lock:
            return sum(1 for e in self._slots.values() if e.pins)

    def used_slots(self) -> int:
        with self._lock:
            return len(self._slots)

    # ------------------------------------------------------------ internals

    def _touch(self, slot: int) -> None:
        if slot in self._lru:
            self._lru.move_to_end(slot)

    def _take_slot(self, evicted: list[BlockKey]) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        slot, _ = self._lru.popitem(last=False)
        entry = self._slots.pop(slot)
        del self._by_key[entry.key]
        evicted.append(entry.key)
        return slot

    def _unpin_slot(self, slot: int) -> None:
        entry = self._slots.get(slot)
        if entry is None:
            return
        entry.pins -= 1
        if entry.pins <= 0:
            entry.pins = 0
            self._lru[slot] = None
            self._lru.move_to_end(slot)
