"""A memory budget for the prefix index: how many entries fit, what they cost, which go first.

The in-memory index (`common.index.CompactPrefixIndex`) is 256 dicts of
int -> int. Its memory is almost all in two places, both computable rather
than guessed:

- each shard's hash table. CPython sizes a dict's table in powers of two:
  `size` index slots (1 byte each up to 128 slots, 2 up to 32,768, 4 beyond)
  plus `2 x size / 3` entries of 24 bytes (hash, key, value). A dict that
  churns at `n` entries (inserts and deletes) is rebuilt at the smallest
  power of two >= 3 x n, and never shrinks on delete. So a shard capped at
  `n` entries never has a table larger than `table_bytes(next_pow2(3 n))`.
  `sys.getsizeof(shard)` reads the real table at any moment.
- each key: a 64-bit int object, 36 bytes by sys.getsizeof (32 below 2^60),
  which pymalloc serves from its 48-byte size class (16-byte alignment on
  64-bit builds): measured, a million such ints grow RSS by 48.2 bytes each.
  The values are shared ids of interned holder sets and cost nothing per
  entry.

Holder sets, slots and transition caches grow with holders, not with blocks,
and are left out. The budget's entry cap per shard is the largest `n` whose
table and keys fit `budget / 256`; bench/scale/index_budget.py measures the
broker's RSS against it.

Which entries go: a shard over its cap forgets a batch of `cap / 16` entries
(at least one) among the `2 x batch` least recently used ones (dicts keep
insertion order, and a match or an announcement moves an entry to the end).
Among those candidates, entries no live holder names go first, then those of
the engine holding the most blocks in the index (its copies are the largest
share, and a small engine keeps its few), oldest first within each.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

KEY_BYTES = 48  # a 64-bit int in pymalloc's 48-byte size class (sys.getsizeof: 36; RSS: 48.2 measured)
ENTRY_BYTES = 24  # one dict entry: hash, key pointer, value pointer
# A dict's fixed part (object, GC header and keys header), calibrated here: {0: 0} has 8 slots, 5 entries.
DICT_BASE_BYTES = sys.getsizeof({0: 0}) - (8 * 1 + 5 * ENTRY_BYTES)
BATCH_DIVISOR = 16  # a shard over its cap forgets cap / 16 entries at once (amortises the scan)


@dataclass(frozen=True, slots=True)
class IndexMemory:
    """What the index says about its memory (all 0 where a backend does not bound or measure it)."""

    budget_bytes: int = 0  # 0: unbounded
    estimated_bytes: int = 0  # tables and keys, as this module counts them
    entries: int = 0  # distinct blocks (keys), whatever the number of holders of each
    entry_cap: int = 0  # most entries the budget allows (0: unbounded)
    forgotten: int = 0  # entries forgotten to stay within the budget, since start


def index_width(slots: int) -> int:
    """Bytes per index slot of a dict table with `slots` slots (CPython 3.11+)."""
    if slots <= 128:
        return 1
    if slots <= 1 << 15:
        return 2
    return 4 if slots <= 1 << 31 else 8


def table_bytes(slots: int) -> int:
    """sys.getsizeof of a dict with int keys whose table has `slots` slots."""
    return DICT_BASE_BYTES + slots * index_width(slots) + (2 * slots // 3) * ENTRY_BYTES


def next_pow2(n: int) -> int:
    return 1 << max(3, (n - 1).bit_length())


def shard_bytes(entries: int) -> int:
    """The most a shard capped at `entries` costs: its largest table plus its keys."""
    return table_bytes(next_pow2(3 * entries)) + entries * KEY_BYTES


def shard_cap(budget_bytes: int, shards: int) -> int:
    """The most entries per shard such that `shards` shards at that cap fit `budget_bytes`."""
    per_shard = budget_bytes // shards
    best = 0
    slots = 8
    while table_bytes(slots) <= per_shard:
        # Entries a table of `slots` slots holds without growing past it, as far as keys fit.
        fits = min(slots // 3, (per_shard - table_bytes(slots)) // KEY_BYTES)
        best = max(best, fits)
        slots *= 2
    return best


def estimate(shards: Iterable[dict[int, int]]) -> tuple[int, int]:
    """(bytes, entries) of the shards now: their real tables plus KEY_BYTES a key."""
    size = entries = 0
    for shard in shards:
        size += sys.getsizeof(shard)
        entries += len(shard)
    return size + entries * KEY_BYTES, entries


def batch_size(cap: int) -> int:
    return max(1, cap // BATCH_DIVISOR)


def pick_forgotten(candidates: list[tuple[int, int]], count: int, weight: Callable[[int], int]) -> list[int]:
    """The `count` keys to forget among `candidates` ((key, holder-set id), oldest first).

    `weight(sid)` ranks a holder set: -1 when no live holder names it (garbage, forgotten
    first), else the most blocks any of its holders' engines has in the index. A pass over
    the candidates per rank, in age order (few distinct ranks: no sort of the candidates)."""
    ranks: dict[tuple[bool, int], set[int]] = {}
    for sid in {sid for _, sid in candidates}:
        w = weight(sid)
        ranks.setdefault((w < 0, w), set()).add(sid)
    if len(ranks) == 1:  # one rank (a shard's oldest all of one engine, say): by age
        return [key for key, _ in candidates[:count]]
    picked: list[int] = []
    for rank in sorted(ranks, reverse=True):  # garbage first, then the heaviest engine's
        group = ranks[rank]
        picked.extend([key for key, sid in candidates if sid in group][: count - len(picked)])
        if len(picked) >= count:
            break
    return picked
