"""Prefix index: which holder (engine, tier) has which blocks, per namespace.

`PrefixIndex` is the interface the core uses; `CompactPrefixIndex` is the
in-memory backend, built to stay small at tens of millions of blocks:

- One table for everything: key = block hash XOR a 64-bit namespace salt (a
  plain int), value = the id of an interned *holder set*. Ids come out of
  the intern table, so every entry shares the same few int objects; the
  per-block cost is the dict slot plus the key int. The table is 256 dicts
  (shards, by the key's low byte), so that whatever walks all of it (a mirror's
  snapshot, the sweep) copies and visits one small shard per step and never
  holds the event loop for a scan of the whole table.
- A holder *slot* stands for one (engine, tier, namespace). Holder sets are
  frozensets of slots; transitions (set + slot, set - slot) are cached, so an
  inventory update is a dict get and a dict set per block.
- Dropping an engine marks its slots dead (O(slots), no per-engine block
  list): lookups filter dead slots at once, and an incremental sweep
  (`maintain`) rewrites the entries later, then recycles the slots.

Isolation: keys are the 64-bit wire hashes XOR a per-namespace salt, so two
namespaces share a key only when h1 ^ salt(A) == h2 ^ salt(B). The salt is a
keyed hash under a secret drawn per index (per process), so no client can
compute salt(A) ^ salt(B) and craft a hash that lands on another tenant's key.
Should two namespaces still share a key (by a 2^-64 accident, or a salt that
leaked), the entry's holder set holds slots of both, and every lookup keeps only
the slots of its own namespace: a prefix never matches across namespaces, by
construction rather than by the salt alone.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, cast

from kvbroker.common.index_budget import IndexMemory, batch_size, estimate, pick_forgotten, shard_cap
from kvbroker.common.model import Namespace, Tier

MASK64 = (1 << 64) - 1
SHARD_BITS = 8
SHARDS = 1 << SHARD_BITS
SHARD_MASK = SHARDS - 1


class PrefixIndex(Protocol):
    def add(self, engine_id: str, tier: Tier, namespace: Namespace, hashes: Iterable[int]) -> int:
        """Record blocks as held; returns how many were new for this holder."""
        ...

    def remove(self, engine_id: str, tier: Tier, namespace: Namespace, hashes: Iterable[int]) -> int:
        """Forget blocks; returns how many this holder had."""
        ...

    def drop_holder(self, engine_id: str, tier: Tier | None = None) -> int:
        """Forget every block of an engine (or of one of its tiers), at once; returns the count."""
        ...

    def longest_prefixes(self, namespace: Namespace, hashes: Iterable[int]) -> list[tuple[str, Tier, int]]:
        """(engine_id, tier, matched) per holder with a non-empty prefix of `hashes` from block 0."""
        ...

    def export(self, layout_id: str, chunk: int) -> Iterator[list[tuple[str, Tier, Namespace, list[int]]]]:
        """Every (engine, tier, namespace, hashes) of a layout, a chunk of the table per step.

        Safe to interleave with updates between steps (for mirror snapshots): each step
        reads the state as it is then."""
        ...

    def blocks_of(self, engine_id: str) -> dict[Tier, int]: ...
    def total_blocks(self) -> int: ...
    def namespace_count(self) -> int: ...
    def take_forgotten(self) -> list[tuple[str, Tier, Namespace, list[int]]]:
        """(engine, tier, namespace, hashes) a bounded index forgot since the last call (for its
        mirrors), at most those of the latest `add` (or `maintain`); taking them clears them."""
        ...

    def maintain(self, budget: int) -> None:
        """Do up to `budget` units of background clean-up (called by the expiry loop)."""
        ...

    def memory(self) -> IndexMemory:
        """Its memory budget, estimated size and entries forgotten to keep to it (common/index_budget.py)."""
        ...


def namespace_salt(namespace: Namespace, key: bytes = b"") -> int:
    """A namespace's 64-bit salt; keyed (blake2b MAC) so that without `key` nobody can predict it."""
    digest = hashlib.blake2b(
        f"{namespace.layout_id}\x00{namespace.tenant}".encode(),
        digest_size=8,
        key=key,
        person=b"kvbroker-ns",
    ).digest()
    return int.from_bytes(digest, "big")


@dataclass(slots=True)
class _Slot:
    engine_id: str
    tier: Tier
    namespace: Namespace
    blocks: int = 0
    alive: bool = True


class CompactPrefixIndex:
    """`memory_budget` (bytes, 0 = unbounded): past it, each shard forgets its least recently used
    entries (common/index_budget.py). A forgotten block is a miss, as if no holder had it: a lookup
    cuts the prefix there, and never names a holder that did not announce the block."""

    def __init__(self, memory_budget: int = 0, salt_key: bytes | None = None) -> None:
        self._shards: list[dict[int, int]] = [{} for _ in range(SHARDS)]
        self._budget = memory_budget
        self._cap = shard_cap(memory_budget, SHARDS) if memory_budget else 0  # entries per shard
        if memory_budget and not self._cap:
            raise ValueError(f"an index memory budget of {memory_budget} bytes holds no entry at all")
        self.forgotten = 0
        # What the latest add forgot, per holder, for the mirrors (take_forgotten).
        self._forgotten_out: dict[tuple[str, Tier, Namespace], list[int]] = {}
        self._salts: dict[Namespace, int] = {}
        # Secret per index: the salts (and so which keys two namespaces could share) are unpredictable.
        self._salt_key = secrets.token_bytes(32) if salt_key is None else salt_key
        # Holder sets, interned.
        self._sets: dict[int, frozenset[int]] = {}
        self._set_id: dict[frozenset[int], int] = {}
        self._set_ids = itertools.count(1)
        self._single: dict[int, int] = {}  # slot -> id of {slot}
        self._add_cache: dict[tuple[int, int], int] = {}
        self._del_cache: dict[tuple[int, int], int | None] = {}
        self._live_cache: dict[int, frozenset[int]] = {}
        # Slots.
        self._slots: dict[int, _Slot] = {}
        self._slot_of: dict[tuple[str, Tier, Namespace], int] = {}
        self._engine_slots: dict[str, set[int]] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._dead: set[int] = set()
        self._dead_blocks = 0  # entries' worth of garbage waiting for a sweep
        self._live_blocks = 0
        self._ns_blocks: dict[Namespace, int] = {}
        self._layout_blocks: dict[str, int] = {}
        # Sweep in progress: shard by shard.
        self._sweeping = False
        self._sweep_shard = 0
        self._sweep_keys: list[int] | None = None
        self._sweep_pos = 0
        self._sweep_dead: frozenset[int] = frozenset()
        self._sweep_blocks = 0

    # -- interning -------------------------------------------------------------

    def _intern(self, slots: frozenset[int]) -> int | None:
        if not slots:
            return None
        sid = self._set_id.get(slots)
        if sid is None:
            sid = next(self._set_ids)
            self._set_id[slots] = sid
            self._sets[sid] = slots
        return sid

    def _salt(self, namespace: Namespace) -> int:
        salt = self._salts.get(namespace)
        if salt is None:
            salt = self._salts[namespace] = namespace_salt(namespace, self._salt_key)
        return salt

    def _slot_for(self, engine_id: str, tier: Tier, namespace: Namespace) -> int:
        key = (engine_id, tier, namespace)
        slot = self._slot_of.get(key)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
            self._slots[slot] = _Slot(engine_id, tier, namespace)
            self._slot_of[key] = slot
            self._engine_slots.setdefault(engine_id, set()).add(slot)
            sid = self._intern(frozenset((slot,)))
            assert sid is not None
            self._single[slot] = sid
        return slot

    def _live(self, sid: int) -> frozenset[int]:
        live = self._live_cache.get(sid)
        if live is None:
            slots = self._sets[sid]
            live = slots - self._dead if self._dead else slots
            self._live_cache[sid] = live
        return live

    # -- updates -----------------------------------------------------------------

    def add(self, engine_id: str, tier: Tier, namespace: Namespace, hashes: Iterable[int]) -> int:
        slot = self._slot_for(engine_id, tier, namespace)
        salt = self._salt(namespace)
        shards = self._shards
        single = self._single[slot]
        cache = self._add_cache
        cap = self._cap
        if self._forgotten_out:
            self._forgotten_out = {}  # not taken: nobody mirrors this index
        added = counted = 0
        for h in hashes:
            key = h ^ salt
            entries = shards[key & SHARD_MASK]
            sid = entries.get(key)
            if sid is None:
                entries[key] = single
                added += 1
                if cap and len(entries) > cap:
                    self._count(slot, added - counted)  # counts up to date: they weigh what goes
                    counted = added
                    self._forget_batch(entries)
                continue
            new = sid
            if sid != single:
                cached = cache.get((sid, slot))
                if cached is None:
                    slots = self._sets[sid]
                    cached = sid if slot in slots else self._intern((slots | {slot}) - self._dead)
                    assert cached is not None
                    cache[(sid, slot)] = cached
                if cached != sid:
                    new = cached
                    added += 1
            if cap:  # bounded: an announced block counts as used now, to the end of the shard's order
                del entries[key]
                entries[key] = new
            elif new != sid:
                entries[key] = new
        self._count(slot, added - counted)
        return added

    def remove(self, engine_id: str, tier: Tier, namespace: Namespace, hashes: Iterable[int]) -> int:
        slot = self._slot_of.get((engine_id, tier, namespace))
        if slot is None:
            return 0
        salt = self._salt(namespace)
        shards = self._shards
        cache = self._del_cache
        removed = 0
        for h in hashes:
            key = h ^ salt
            entries = shards[key & SHARD_MASK]
            sid = entries.get(key)
            if sid is None:
                continue
            pair = (sid, slot)
            if pair in cache:
                new = cache[pair]
            else:
                slots = self._sets[sid]
                new = sid if slot not in slots else self._intern(slots - {slot} - self._dead)
                cache[pair] = new
            if new == sid:
                continue
            if new is None:
                del entries[key]
            else:
                entries[key] = new
            removed += 1
        self._count(slot, -removed)
        return removed

    def _count(self, slot: int, delta: int) -> None:
        if delta:
            info = self._slots[slot]
            info.blocks += delta
            self._live_blocks += delta
            self._ns_blocks[info.namespace] = self._ns_blocks.get(info.namespace, 0) + delta
            if not self._ns_blocks[info.namespace]:
                del self._ns_blocks[info.namespace]
            layout = info.namespace.layout_id
            self._layout_blocks[layout] = self._layout_blocks.get(layout, 0) + delta
            if not self._layout_blocks[layout]:
                del self._layout_blocks[layout]

    def drop_holder(self, engine_id: str, tier: Tier | None = None) -> int:
        slots = self._engine_slots.get(engine_id)
        if not slots:
            return 0
        dropped = 0
        for slot in [s for s in slots if tier is None or self._slots[s].tier == tier]:
            info = self._slots[slot]
            dropped += info.blocks
            self._dead_blocks += info.blocks
            self._count(slot, -info.blocks)
            info.alive = False
            slots.discard(slot)
            del self._slot_of[(engine_id, info.tier, info.namespace)]
            self._dead.add(slot)
        if not slots:
            del self._engine_slots[engine_id]
        # Cached transitions and live views may name the dead slots: rebuild lazily.
        self._add_cache.clear()
        self._del_cache.clear()
        self._live_cache.clear()
        return dropped

    # -- lookups -----------------------------------------------------------------

    def longest_prefixes(self, namespace: Namespace, hashes: Iterable[int]) -> list[tuple[str, Tier, int]]:
        salt = self._salts.get(namespace)
        if salt is None:
            return []  # nothing was ever stored in this namespace
        shards = self._shards
        chain = hashes if isinstance(hashes, list | tuple) else list(hashes)
        if not chain:
            return []
        first = chain[0] ^ salt
        if shards[first & SHARD_MASK].get(first) is None:
            return []  # the common miss costs one lookup
        # Look every block up, cut at the first block nobody holds.
        keys = [h ^ salt for h in chain]
        found = [shards[k & SHARD_MASK].get(k) for k in keys]
        n = found.index(None) if None in found else len(found)
        if self._cap:
            self._touch(keys[:n])
        sids = cast(list[int], found[:n])
        slots = self._slots
        prev = sids[0]
        # Only this namespace's slots count, whatever else shares the keys (see Isolation above).
        active = frozenset(s for s in self._live(prev) if slots[s].namespace == namespace)
        if not active:
            return []
        if sids.count(prev) == n:  # one holder set all along (the usual case)
            return [(slots[s].engine_id, slots[s].tier, n) for s in active]
        # Holder sets change along the chain: narrow the active set where they do.
        matched: list[tuple[int, int]] = []
        for i in range(1, n):
            sid = sids[i]
            if sid != prev:
                narrowed = active & self._live(sid)
                if narrowed != active:
                    matched.extend((s, i) for s in active - narrowed)
                    active = narrowed
                    if not active:
                        break
                prev = sid
        matched.extend((s, n) for s in active)  # still active: held to the end
        return [(slots[s].engine_id, slots[s].tier, m) for s, m in matched]

    def _touch(self, keys: list[int]) -> None:
        """Matched entries count as used now: to the end of their shard's order (bounded index only)."""
        shards = self._shards
        for key in keys:
            entries = shards[key & SHARD_MASK]
            entries[key] = entries.pop(key)

    def export(self, layout_id: str, chunk: int) -> Iterator[list[tuple[str, Tier, Namespace, list[int]]]]:
        if not self._layout_blocks.get(layout_id):
            return  # nothing of this layout: no walk at all
        for entries in self._shards:
            # One shard's keys at a time: a copy of 1/256 of the table, then steps of `chunk`.
            keys = list(entries)
            for start in range(0, len(keys), chunk):
                yield self._export_step(entries, keys[start : start + chunk], layout_id)
            if not keys:
                yield []  # a step per shard, even an empty one: the caller may yield the loop

    def _export_step(
        self, entries: dict[int, int], keys: list[int], layout_id: str
    ) -> list[tuple[str, Tier, Namespace, list[int]]]:
        groups: dict[int, list[int]] = {}
        slots = self._slots
        for key in keys:
            sid = entries.get(key)
            if sid is None:
                continue
            for slot in self._live(sid):
                ns = slots[slot].namespace
                if ns.layout_id == layout_id:
                    groups.setdefault(slot, []).append(key ^ self._salts[ns])
        return [(slots[s].engine_id, slots[s].tier, slots[s].namespace, hs) for s, hs in groups.items()]

    def blocks_of(self, engine_id: str) -> dict[Tier, int]:
        counts = {Tier.GPU: 0, Tier.CPU: 0}
        for slot in self._engine_slots.get(engine_id, ()):
            info = self._slots[slot]
            counts[info.tier] += info.blocks
        return counts

    def total_blocks(self) -> int:
        return self._live_blocks

    def namespace_count(self) -> int:
        return len(self._ns_blocks)

    # -- memory budget -----------------------------------------------------------

    def memory(self) -> IndexMemory:
        size, entries = estimate(self._shards)
        return IndexMemory(self._budget, size, entries, self._cap * SHARDS, self.forgotten)

    def _forget_batch(self, entries: dict[int, int]) -> None:
        """Forget a batch of a shard's least valuable entries (common/index_budget.py says which)."""
        want = batch_size(self._cap)
        candidates = list(itertools.islice(entries.items(), 2 * want))
        slots = self._slots
        totals: dict[str, int] = {}

        def weight(sid: int) -> int:
            best = -1
            for s in self._live(sid):
                engine = slots[s].engine_id
                total = totals.get(engine)
                if total is None:
                    total = totals[engine] = sum(slots[x].blocks for x in self._engine_slots.get(engine, ()))
                best = max(best, total)
            return best

        per_set: dict[int, list[int]] = {}
        picked = pick_forgotten(candidates, want, weight)
        for key in picked:
            per_set.setdefault(entries.pop(key), []).append(key)
        out = self._forgotten_out
        for sid, keys in per_set.items():
            for s in self._live(sid):
                self._count(s, -len(keys))
                info = slots[s]
                salt = self._salts[info.namespace]
                out.setdefault((info.engine_id, info.tier, info.namespace), []).extend(k ^ salt for k in keys)
        self.forgotten += len(picked)

    def take_forgotten(self) -> list[tuple[str, Tier, Namespace, list[int]]]:
        out, self._forgotten_out = self._forgotten_out, {}
        return [(engine_id, tier, ns, hashes) for (engine_id, tier, ns), hashes in out.items()]

    # -- background sweep --------------------------------------------------------

    def maintain(self, budget: int) -> None:
        if not self._sweeping:
            # Sweep once garbage is a quarter of the table (amortised O(1) per dropped block).
            if not self._dead or self._dead_blocks * 4 < sum(map(len, self._shards)):
                return
            self._sweeping = True
            self._sweep_shard = 0
            self._sweep_keys = None
            self._sweep_dead = frozenset(self._dead)
            self._sweep_blocks = self._dead_blocks
        cleaned: dict[int, int | None] = {}
        dead = self._sweep_dead
        while budget > 0 and self._sweep_shard < SHARDS:
            entries = self._shards[self._sweep_shard]
            if self._sweep_keys is None:
                self._sweep_keys = list(entries)
                self._sweep_pos = 0
            keys = self._sweep_keys
            end = min(self._sweep_pos + budget, len(keys))
            budget -= end - self._sweep_pos + 1
            for key in keys[self._sweep_pos : end]:
                sid = entries.get(key)
                if sid is None:
                    continue
                if sid in cleaned:
                    new = cleaned[sid]
                else:
                    slots = self._sets[sid]
                    new = sid if slots.isdisjoint(dead) else self._intern(slots - dead)
                    cleaned[sid] = new
                if new != sid:
                    if new is None:
                        del entries[key]
                    else:
                        entries[key] = new
            self._sweep_pos = end
            if end >= len(keys):
                self._sweep_shard += 1
                self._sweep_keys = None
        if self._sweep_shard >= SHARDS:
            self._finish_sweep()

    def _finish_sweep(self) -> None:
        dead = self._sweep_dead
        for slots, sid in list(self._set_id.items()):
            if not slots.isdisjoint(dead):
                del self._set_id[slots]
                del self._sets[sid]
        for slot in dead:
            del self._slots[slot]
            del self._single[slot]
            self._free_slots.append(slot)
        self._dead -= dead
        self._dead_blocks -= self._sweep_blocks
        self._add_cache.clear()
        self._del_cache.clear()
        self._live_cache.clear()
        self._sweeping = False
        self._sweep_keys = None
        self._sweep_dead = frozenset()
        self._sweep_blocks = 0
