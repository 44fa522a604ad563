"""The PrefixIndex on Redis/Valkey, shared by every broker replica of a fleet.

Keys are sharded by namespace: all keys of one namespace carry the same hash
tag (`{<namespace id>}`), so on a Redis Cluster a namespace lives on one slot
and a whole chain resolves in one round trip: a Lua script walks the chain on
the server and answers only (holder, matched) pairs.

Per namespace:
- `ix`: a hash, field = the block hash (8 bytes), value = the holder slots
  that hold it, comma separated ("3" or "3,7"). One field per block: the
  per-block cost is one small hash entry.
- `slot` / `slotof`: holder slot id <-> "engine<TAB>tier"; `cnt`: blocks per
  slot; `seq`: slot ids (never reused, so a stale id never names a new holder).

Dropping an engine removes its slots from `slot` at once (O(slots)); values
still naming a dead slot are filtered by every lookup and rewritten later by
an incremental sweep (`maintain`), as the in-memory index does.
Namespaces are separate keys, so no prefix matches across namespaces.

Bounded by --index-max-entries (0: unbounded), or by bytes with
--index-memory-mib (an entry bound derived from the store's own bytes per
entry, broker/fleet/index_bytes.py): past it the fleet forgets its least
recently announced or matched blocks, in bounded work per call
(broker/fleet/index_bound.py says which and how); a forgotten block is a miss.
What was forgotten is handed to the caller (`take_forgotten`) for the mirrors.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvbroker.broker.fleet.conn import RedisState
from kvbroker.broker.fleet.index_bound import (
    BOUND_CHECK_S,
    FORGET,
    FORGET_STEP,
    RECOUNT_S,
    TOUCH,
    Forgotten,
    decode_forgotten,
    forget_batch,
)
from kvbroker.broker.fleet.index_bytes import MEMORY_SAMPLES, NAMESPACE_KEYS, StoreEntryBytes
from kvbroker.common.index_budget import IndexMemory
from kvbroker.common.model import Namespace, Tier

IDLE_SWEEP_S = 0.5  # with no namespace to tidy, how long `maintain` waits before it looks again

_HAS = "local function has(v, s) return string.find(',' .. v .. ',', ',' .. s .. ',', 1, true) ~= nil end\n"

# KEYS: ix, slot, slotof, cnt, seq, lru, tick.  ARGV: "engine\ttier", packed hashes, "1" when bounded.
# -> {added (holder, block) pairs, new entries}
_ADD = (
    _HAS
    + TOUCH
    + """
local slot = redis.call('HGET', KEYS[3], ARGV[1])
if not slot then
  slot = tostring(redis.call('INCR', KEYS[5]))
  redis.call('HSET', KEYS[3], ARGV[1], slot)
  redis.call('HSET', KEYS[2], slot, ARGV[1])
end
local data, added, created = ARGV[2], 0, 0
for i = 1, #data, 8 do
  local h = string.sub(data, i, i + 7)
  local v = redis.call('HGET', KEYS[1], h)
  if not v then
    redis.call('HSET', KEYS[1], h, slot); added = added + 1; created = created + 1
  elseif not has(v, slot) then
    redis.call('HSET', KEYS[1], h, v .. ',' .. slot); added = added + 1
  end
end
if added > 0 then redis.call('HINCRBY', KEYS[4], slot, added) end
if ARGV[3] ~= '' then touch(KEYS[6], KEYS[7], data, #data / 8) end
return {added, created}
"""
)

_WITHOUT = """
local function without(v, s)
  local out = {}
  for tok in string.gmatch(v, '[^,]+') do if tok ~= s then table.insert(out, tok) end end
  return table.concat(out, ',')
end
"""

# KEYS: ix, slotof, cnt, lru.  ARGV: "engine\ttier", packed hashes.  -> {removed, entries deleted}
_REMOVE = (
    _HAS
    + _WITHOUT
    + """
local slot = redis.call('HGET', KEYS[2], ARGV[1])
if not slot then return {0, 0} end
local data, removed, deleted = ARGV[2], 0, 0
for i = 1, #data, 8 do
  local h = string.sub(data, i, i + 7)
  local v = redis.call('HGET', KEYS[1], h)
  if v and has(v, slot) then
    local rest = without(v, slot)
    if rest == '' then
      redis.call('HDEL', KEYS[1], h); redis.call('ZREM', KEYS[4], h); deleted = deleted + 1
    else
      redis.call('HSET', KEYS[1], h, rest)
    end
    removed = removed + 1
  end
end
if removed > 0 then redis.call('HINCRBY', KEYS[3], slot, -removed) end
return {removed, deleted}
"""
)

# KEYS: slot, slotof, cnt.  ARGV: "engine\ttier"...  -> {dropped blocks, slots left for the engine}
_DROP = """
local dropped = 0
for i = 1, #ARGV do
  local slot = redis.call('HGET', KEYS[2], ARGV[i])
  if slot then
    dropped = dropped + tonumber(redis.call('HGET', KEYS[3], slot) or '0')
    redis.call('HDEL', KEYS[2], ARGV[i]); redis.call('HDEL', KEYS[1], slot); redis.call('HDEL', KEYS[3], slot)
  end
end
return dropped
"""

# KEYS: ix, slot, lru, tick.  ARGV: packed hashes, "1" when bounded (the matched blocks are
# touched).  -> {"engine\ttier", matched, ...}
_LONGEST = (
    _HAS
    + TOUCH
    + """
local data = ARGV[1]
local n = #data / 8
if n == 0 then return {} end
local first = redis.call('HGET', KEYS[1], string.sub(data, 1, 8))
if not first then return {} end
local live = {}
local raw = redis.call('HGETALL', KEYS[2])
for i = 1, #raw, 2 do live[raw[i]] = raw[i + 1] end
local active, count = {}, 0
for tok in string.gmatch(first, '[^,]+') do
  if live[tok] then active[tok] = true; count = count + 1 end
end
local out = {}
local i = 2
while count > 0 and i <= n do
  local v = redis.call('HGET', KEYS[1], string.sub(data, (i - 1) * 8 + 1, i * 8))
  for s in pairs(active) do
    if not v or not has(v, s) then
      table.insert(out, live[s]); table.insert(out, i - 1); active[s] = nil; count = count - 1
    end
  end
  i = i + 1
end
for s in pairs(active) do table.insert(out, live[s]); table.insert(out, n) end
if ARGV[2] ~= '' and #out > 0 then
  local most = 0
  for j = 2, #out, 2 do if out[j] > most then most = out[j] end end
  touch(KEYS[3], KEYS[4], data, most)
end
return out
"""
)

# KEYS: ix, slot, lru.  ARGV: cursor, count.  Rewrites values naming dead slots.  -> {next cursor, deleted}
_SWEEP = """
local live = {}
local raw = redis.call('HGETALL', KEYS[2])
for i = 1, #raw, 2 do live[raw[i]] = true end
local page = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', tonumber(ARGV[2]))
local items, deleted = page[2], 0
for i = 1, #items, 2 do
  local keep = {}
  local v = redis.call('HGET', KEYS[1], items[i])
  if v then
    for tok in string.gmatch(v, '[^,]+') do if live[tok] then table.insert(keep, tok) end end
    local rest = table.concat(keep, ',')
    if rest == '' then
      redis.call('HDEL', KEYS[1], items[i]); redis.call('ZREM', KEYS[3], items[i]); deleted = deleted + 1
    elseif rest ~= v then redis.call('HSET', KEYS[1], items[i], rest) end
  end
end
return {page[1], deleted}
"""

_Q = struct.Struct(">Q")
TIERS = (Tier.GPU, Tier.CPU)


def namespace_id(namespace: Namespace) -> str:
    """A namespace's key tag: a digest, so tenant and layout strings never shape key names."""
    text = f"{namespace.layout_id}\x00{namespace.tenant}".encode()
    return hashlib.blake2b(text, digest_size=10, person=b"kvbroker-ns").hexdigest()


def _holder(engine_id: str, tier: Tier) -> str:
    return f"{engine_id}\t{int(tier)}"


def _pack(hashes: Iterable[int]) -> bytes:
    return b"".join(_Q.pack(h) for h in hashes)


class RedisPrefixIndex:
    """`max_entries`: the most distinct blocks the fleet's index keeps (0: unbounded); or
    `memory_bytes`: the most bytes its keys take in the store (an entry bound derived from them)."""

    def __init__(
        self,
        state: RedisState,
        max_entries: int = 0,
        memory_bytes: int = 0,
        stream_keys: Callable[[str], list[str]] | None = None,
        stream_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """`stream_keys(layout_id)`: the keys of that layout's mirror change stream (the stream
        first), counted in a bytes budget beside the entries (index_bytes.py); `stream_bytes(n)` is
        told the bytes each stream may keep under that budget, now and at each recount."""
        if max_entries and memory_bytes:
            raise ValueError("bound the store's index by entries or by bytes, not both")
        self._state = state
        self._bytes = StoreEntryBytes(memory_bytes) if memory_bytes else None
        self._stream_keys = stream_keys
        self._stream_bytes = stream_bytes if self._bytes is not None else None
        if self._stream_bytes is not None and self._bytes is not None:
            self._stream_bytes(self._bytes.stream_bytes)
        self._cap = self._bytes.bound if self._bytes is not None else max_entries
        self._bounded = "1" if self._cap else ""
        self._forget = state.script(FORGET)
        self._entries_key = f"{state.prefix}:ixn"
        self.forgotten = 0  # entries this replica forgot to keep to the bound, since start
        self._forgotten_out: Forgotten = []
        self._recount_at = self._bound_at = 0.0
        self._r: Any = state.client  # redis-py's return types are unions of every reply shape
        self._p = state.prefix
        self._add = state.script(_ADD)
        self._remove = state.script(_REMOVE)
        self._drop = state.script(_DROP)
        self._longest = state.script(_LONGEST)
        self._sweep = state.script(_SWEEP)
        self._known: set[str] = set()  # namespaces this replica has recorded in the namespace map
        self._sweep_cursor: dict[str, bytes] = {}
        self._idle_until = 0.0

    def _keys(self, nsid: str, *names: str) -> list[str]:
        return [f"{self._p}:{{{nsid}}}:{name}" for name in names]

    def _engine_key(self, engine_id: str) -> str:
        return f"{self._p}:eng:{engine_id}"

    def _namespaces(self) -> dict[str, Namespace]:
        raw = self._state.call(self._r.hgetall, f"{self._p}:namespaces")
        out: dict[str, Namespace] = {}
        for nsid, text in raw.items():
            layout, _, tenant = text.decode().partition("\x00")
            out[nsid.decode()] = Namespace(layout, tenant)
        return out

    # -- updates -------------------------------------------------------------------

    def add(self, engine_id: str, tier: Tier, namespace: Namespace, hashes: Iterable[int]) -> int:
        self._forgotten_out = []  # not taken since the last call: nobody mirrors this index
        nsid = namespace_id(namespace)
        packed = _pack(hashes)
        if not packed:
            return 0
        if nsid not in self._known:
            text = f"{namespace.layout_id}\x00{namespace.tenant}"
            self._state.call(self._r.hset, f"{self._p}:namespaces", nsid, text)
            self._known.add(nsid)
        self._state.call(self._r.sadd, self._engine_key(engine_id), nsid)
        keys = self._keys(nsid, "ix", "slot", "slotof", "cnt", "seq", "lru", "tick")
        added, created = self._state.run(self._add, keys, [_holder(engine_id, tier), packed, self._bounded])
        if self._cap and created:
            total = int(self._state.call(self._r.incrby, self._entries_key, created))
            self._forget_in(nsid, namespace, forget_batch(self._cap, total))
        return int(added)

    def remove(self, engine_id: str, tier: Tier, namespace: Namespace, hashes: Iterable[int]) -> int:
        packed = _pack(hashes)
        if not packed:
            return 0
        keys = self._keys(namespace_id(namespace), "ix", "slotof", "cnt", "lru")
        removed, deleted = self._state.run(self._remove, keys, [_holder(engine_id, tier), packed])
        self._deleted(int(deleted))
        return int(removed)

    def drop_holder(self, engine_id: str, tier: Tier | None = None) -> int:
        tiers = TIERS if tier is None else (tier,)
        holders = [_holder(engine_id, t) for t in tiers]
        dropped = 0
        for raw in self._state.call(self._r.smembers, self._engine_key(engine_id)):
            nsid = raw.decode()
            keys = self._keys(nsid, "slot", "slotof", "cnt")
            dropped += self._state.call(self._drop, keys=keys, args=holders)
            self._state.call(self._r.sadd, f"{self._p}:dirty", nsid)
            self._idle_until = 0.0  # ours to tidy: from the next pass on
        if tier is None:
            self._state.call(self._r.delete, self._engine_key(engine_id))
        return dropped

    # -- lookups -------------------------------------------------------------------

    def longest_prefixes(self, namespace: Namespace, hashes: Iterable[int]) -> list[tuple[str, Tier, int]]:
        packed = _pack(hashes)
        if not packed:
            return []
        keys = self._keys(namespace_id(namespace), "ix", "slot", "lru", "tick")
        flat = self._state.run(self._longest, keys, [packed, self._bounded])
        out: list[tuple[str, Tier, int]] = []
        for i in range(0, len(flat), 2):
            engine_id, _, tier = flat[i].decode().rpartition("\t")
            out.append((engine_id, Tier(int(tier)), int(flat[i + 1])))
        return out

    def export(self, layout_id: str, chunk: int) -> Iterator[list[tuple[str, Tier, Namespace, list[int]]]]:
        for nsid, ns in self._namespaces().items():
            if ns.layout_id != layout_id:
                continue
            ix, slot = self._keys(nsid, "ix", "slot")
            cursor: int | bytes = 0
            while True:
                cursor, items = self._state.call(self._r.hscan, ix, cursor, count=chunk)
                live = {k: v.decode() for k, v in self._state.call(self._r.hgetall, slot).items()}
                groups: dict[bytes, list[int]] = {}
                for field, value in items.items():
                    for tok in value.split(b","):
                        if tok in live:
                            groups.setdefault(tok, []).append(_Q.unpack(field)[0])
                step: list[tuple[str, Tier, Namespace, list[int]]] = []
                for tok, hs in groups.items():
                    engine_id, _, tier = live[tok].rpartition("\t")
                    step.append((engine_id, Tier(int(tier)), ns, hs))
                yield step
                if not cursor or cursor == b"0":
                    break

    def blocks_of(self, engine_id: str) -> dict[Tier, int]:
        counts = {Tier.GPU: 0, Tier.CPU: 0}
        for raw in self._state.call(self._r.smembers, self._engine_key(engine_id)):
            slotof, cnt = self._keys(raw.decode(), "slotof", "cnt")
            for t in TIERS:
                slot = self._state.call(self._r.hget, slotof, _holder(engine_id, t))
                if slot is not None:
                    counts[t] += int(self._state.call(self._r.hget, cnt, slot) or 0)
        return counts

    def _per_namespace(self) -> list[int]:
        totals = []
        for nsid in self._namespaces():
            (cnt,) = self._keys(nsid, "cnt")
            totals.append(sum(int(v) for v in self._state.call(self._r.hvals, cnt)))
        return totals

    def total_blocks(self) -> int:
        return sum(self._per_namespace())

    def namespace_count(self) -> int:
        return sum(1 for n in self._per_namespace() if n > 0)

    def memory(self) -> IndexMemory:
        """Bounded: the fleet's entries against the bound, and what this replica forgot. The bytes
        are not measured here (the store's memory is Redis's INFO memory)."""
        if not self._cap:
            return IndexMemory()
        entries = int(self._state.call(self._r.get, self._entries_key) or 0)
        if self._bytes is not None:  # a bytes budget: entries at the store's own bytes per entry, streams
            estimate = int(entries * self._bytes.per_entry) + self._bytes.beside_bytes
            return IndexMemory(self._bytes.budget_bytes, estimate, entries, self._cap, self.forgotten)
        return IndexMemory(entries=entries, entry_cap=self._cap, forgotten=self.forgotten)

    # -- the bound (broker/fleet/index_bound.py) ---------------------------------------

    def _deleted(self, n: int) -> None:
        if self._cap and n:
            self._state.call(self._r.incrby, self._entries_key, -n)

    def _forget_in(self, nsid: str, namespace: Namespace, want: int) -> int:
        """Forget up to `want` of the namespace's least valuable entries; how many went."""
        keys = self._keys(nsid, "ix", "slot", "cnt", "lru")
        gone = 0
        while gone < want:
            flat = self._state.run(self._forget, keys, [min(want - gone, FORGET_STEP)])
            deleted, popped = int(flat[0]), int(flat[1])
            if not popped:
                break  # nothing left to forget here (entries not in `lru`: announced before the bound)
            gone += deleted
            self._forgotten_out.extend(decode_forgotten(namespace, flat[2:], lambda b: _Q.unpack(b)[0]))
        if gone:
            self._deleted(gone)
            self.forgotten += gone
        return gone

    def take_forgotten(self) -> Forgotten:
        """The holders' blocks forgotten since the last call (for the mirrors), and forget them."""
        out, self._forgotten_out = self._forgotten_out, []
        return out

    def _sizes(self) -> list[tuple[int, str, Namespace]]:
        """(entries, id, namespace) of every namespace: one HLEN each."""
        return [
            (int(self._state.call(self._r.hlen, self._keys(nsid, "ix")[0])), nsid, ns)
            for nsid, ns in self._namespaces().items()
        ]

    def _keep_bound(self) -> None:
        """Maintenance: recount the fleet's entries now and then, and past the bound forget a step
        in the namespace with the most entries."""
        wall = time.monotonic()
        if wall < self._bound_at:
            return
        sizes: list[tuple[int, str, Namespace]] | None = None
        if wall >= self._recount_at:
            self._recount_at = wall + RECOUNT_S
            sizes = self._sizes()
            total = sum(n for n, _, _ in sizes)
            self._state.call(self._r.set, self._entries_key, total)
            if self._bytes is not None:
                self._calibrate(sizes)
        else:
            total = int(self._state.call(self._r.get, self._entries_key) or 0)
        want = forget_batch(self._cap, total)
        if not want:
            self._bound_at = wall + BOUND_CHECK_S  # within the bound: look again in a while
            return
        biggest = max(sizes if sizes is not None else self._sizes(), default=None)
        if biggest is not None and biggest[0]:
            self._forget_in(biggest[1], biggest[2], min(want, FORGET_STEP))  # one step a pass

    def _calibrate(self, sizes: list[tuple[int, str, Namespace]]) -> None:
        """A bytes budget: the entry bound again, from the store's bytes per entry now (a larger
        figure lowers it, and the passes that follow forget down to it)."""
        assert self._bytes is not None

        def usage(key: str) -> int | None:
            return self._state.call(self._r.memory_usage, key, samples=MEMORY_SAMPLES)  # type: ignore[no-any-return]

        if self._stream_keys is not None:
            layouts = sorted({ns.layout_id for _, _, ns in sizes})
            self._bytes.measure_beside([self._stream_keys(lid) for lid in layouts], usage)
            if self._stream_bytes is not None:
                self._stream_bytes(self._bytes.stream_bytes)
        self._bytes.calibrate(
            [(n, nsid) for n, nsid, _ in sizes], lambda nsid: self._keys(nsid, *NAMESPACE_KEYS), usage
        )
        self._cap = self._bytes.bound

    def maintain(self, budget: int) -> None:
        """Keep to the bound; rewrite up to about `budget` entries of one namespace that names
        dropped holders."""
        self._forgotten_out = []
        if self._cap:
            self._keep_bound()
        wall = time.monotonic()
        if wall < self._idle_until:
            return  # nothing was dirty a moment ago: look again in a while, not every pass
        nsid_raw = self._state.command("SRANDMEMBER", f"{self._p}:dirty")
        if nsid_raw is None:
            self._idle_until = wall + IDLE_SWEEP_S
            return
        nsid = nsid_raw.decode()
        cursor = self._sweep_cursor.get(nsid, b"0")
        keys = self._keys(nsid, "ix", "slot", "lru")
        cursor, deleted = self._state.call(self._sweep, keys=keys, args=[cursor, max(budget, 10)])
        self._deleted(int(deleted))
        if cursor in (b"0", 0, "0"):
            self._sweep_cursor.pop(nsid, None)
            self._state.call(self._r.srem, f"{self._p}:dirty", nsid)
        else:
            self._sweep_cursor[nsid] = cursor
