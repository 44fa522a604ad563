"""A bound on the shared store's prefix index (--index-max-entries): which entries go, in bounded work.

The in-memory index is bounded by bytes (--index-memory-mib, common/index_budget.py)
because its bytes are computable. Redis's are not (encodings change with sizes,
jemalloc rounds), so the store's index is bounded by what its memory follows:
distinct blocks (entries of the namespaces' `ix` hashes), fleet-wide. An operator
sizes it from Redis's own figure: bench/scale/index_budget.py --state measures
the store's bytes per entry.

Bookkeeping, only when a bound is set:

- `lru`, per namespace (a sorted set beside `ix`, same hash tag): member = the
  block hash, score = when it was last announced or matched, on the
  namespace's own counter `tick` (exact and shared by every replica, unlike
  their clocks). Within one announcement or match a chain's first block counts
  as the most recent, so a chain is cut from its end, never at block 0 while
  its later blocks stay. Announcements and lookups refresh it in the scripts
  that already run for them, so the bound costs no extra round trip on a lookup.
- `ixn`: the fleet's entry count, one key (changed by each replica by what its
  scripts created and deleted; recounted from the namespaces' HLEN now and then,
  so a replica that died between a script and its count does not skew it for long).

Which go: a namespace forgets at most MAX_FORGET entries per call, in scripts
of FORGET_STEP, the least recently used ones of its `lru` (ZPOPMIN), whoever
holds them. The in-memory index's rule among the oldest (the engine with the
most blocks first) is left out here: choosing among twice the candidates by
weight made forgetting cost 2.5x the store's time (measured, 256 entries: 2.0
against 0.8 ms at best), and every script blocks the store for every replica.
A forgotten entry leaves `ix` (a lookup misses it: the prefix is cut there,
never another holder named) and its holders' counts. Where: an announcement that
takes the fleet past the bound forgets in its own namespace, right after it
(the announcer's namespace is the one growing); the periodic maintenance pass,
which keeps to a bound that was lowered (or that announcements elsewhere
overshot), forgets in the namespace with the most entries.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbroker.common.model import Namespace, Tier

# Most entries one call forgets: the work a call adds is bounded whatever the excess ...
MAX_FORGET = 1024
# ... in scripts of at most this many (about 3 ms of the store's time each: a script blocks the
# store for every replica, so none may run long).
FORGET_STEP = 256
# How often the fleet's entry count is recounted from the namespaces (seconds).
RECOUNT_S = 10.0
# How often maintenance looks at the count while within the bound (seconds; past it: every pass).
BOUND_CHECK_S = 1.0


def forget_batch(cap: int, total: int) -> int:
    """How many entries to forget when the fleet holds `total` against `cap`: the excess plus a
    sixteenth of the cap (so the next announcements do not each pay a forget), at most MAX_FORGET."""
    if not cap or total <= cap:
        return 0
    return min(total - cap + max(1, cap // 16), MAX_FORGET)


# The first `n` of the packed 8-byte hashes `data` were used now: the namespace's counter `tick`
# moves on by n, and block i gets score top - i (block 0 the most recent).
_TOUCH = """
local function touch(lru, tick, data, n)
  if n <= 0 then return end
  local top = redis.call('INCRBY', tick, n)
  local args, k = {}, 0
  for i = 1, n do
    args[k + 1] = top - i + 1; args[k + 2] = string.sub(data, (i - 1) * 8 + 1, i * 8); k = k + 2
    if k >= 1000 then redis.call('ZADD', lru, unpack(args, 1, k)); k = 0 end
  end
  if k > 0 then redis.call('ZADD', lru, unpack(args, 1, k)) end
end
"""

# KEYS: ix, slot, cnt, lru.  ARGV: want.  The least recently used `want`, whoever holds them.
# -> {deleted entries, popped members, hash, holders ("engine\ttier" of live slots joined by "\n"), ...}
FORGET = r"""
local popped = redis.call('ZPOPMIN', KEYS[4], tonumber(ARGV[1]))
local live, raw = {}, redis.call('HGETALL', KEYS[2])
for i = 1, #raw, 2 do live[raw[i]] = raw[i + 1] end
local out, deleted, dec = {0, #popped / 2}, 0, {}
for i = 1, #popped, 2 do
  local h = popped[i]
  local v = redis.call('HGET', KEYS[1], h)
  if v then  -- else left by an entry deleted elsewhere: no longer counted
    redis.call('HDEL', KEYS[1], h)
    deleted = deleted + 1
    local holders = {}
    for tok in string.gmatch(v, '[^,]+') do
      local holder = live[tok]
      if holder then dec[tok] = (dec[tok] or 0) + 1; table.insert(holders, holder) end
    end
    table.insert(out, h); table.insert(out, table.concat(holders, '\n'))
  end
end
for s, n in pairs(dec) do redis.call('HINCRBY', KEYS[3], s, -n) end
out[1] = deleted
return out
"""


Forgotten = list[tuple[str, Tier, Namespace, list[int]]]  # (engine, tier, namespace, hashes) it no longer has


def decode_forgotten(namespace: Namespace, flat: Sequence[bytes], unpack: object) -> Forgotten:
    """FORGET's answer (after its two counts) as the holders' blocks that were forgotten."""
    by_holder: dict[str, list[int]] = {}
    for i in range(0, len(flat), 2):
        h = unpack(flat[i])  # type: ignore[operator]
        for holder in flat[i + 1].decode().split("\n") if flat[i + 1] else ():
            by_holder.setdefault(holder, []).append(h)
    out: Forgotten = []
    for holder, hashes in by_holder.items():
        engine_id, _, tier = holder.rpartition("\t")
        out.append((engine_id, Tier(int(tier)), namespace, hashes))
    return out


TOUCH = _TOUCH
