"""A bytes budget for the shared store's prefix index (--index-memory-mib with --state).

The store's bytes per entry cannot be computed from here the way the
in-memory index's are (common/index_budget.py): Redis changes a hash's and a
sorted set's encoding with their sizes (a compact listpack while small, a
hash table and a skiplist past `hash-max-listpack-entries` /
`zset-max-listpack-entries`), and its allocator rounds. But Redis can be
asked: `MEMORY USAGE key SAMPLES n` is its own count of a key's bytes
(exact for the key's structure, its elements sampled and extrapolated; an
index's elements are alike: an 8-byte field and a short holder list, a
member and a score). So the budget is kept as an entry bound derived from
the store's own figure:

    entry bound = budget bytes / bytes per entry

where bytes per entry is the MEMORY USAGE of every key of a few sampled
namespaces (`ix`, `lru` and the small per-namespace keys) over their
entries. It is measured again at every recount of the fleet's entries
(index_bound.RECOUNT_S), on the largest namespaces and a few random others,
and replaces the figure when the sample holds at least MIN_SAMPLE_ENTRIES
entries; until then the prior is used, the figure measured at 100,000
entries (hash table and skiplist encodings, the dearest: bench/scale/
store_index_bound.py), so a young index errs on the small side. When the
figure grows (namespaces outgrow their compact encodings) the bound drops
and the maintenance pass forgets down to it, as for a bound an operator
lowered.

What the budget covers: the namespaces' index keys and the index's change
streams for mirrors (one per layout, the last minute of changes:
broker/fleet/mirror.py), as MEMORY USAGE counts them. The streams get a fixed
share of the budget (STREAM_SHARE), split between the layouts' streams
(`stream_bytes`): each replica trims a stream by count too, at every append,
to its bytes over what an entry costs (estimated from the bodies it appends:
mirror.MirrorStreams), and a mirror further behind than the stream reaches
resyncs, as after any gap. The entries get the rest. A stream's bytes are
bounded at the write, not at the next recount: a minute of announcing at
tens of thousands of blocks a second is tens of MiB of stream, which a 10 s
recount cannot follow. The streams' bytes are measured at each recount too;
if they exceed their share (the count trim is approximate: whole nodes of a
hundred entries; and an estimate) the excess comes off the entries' share
(`beside_bytes`). Not covered: lease and registry keys (bounded by their
own limits), and Redis's own overhead and fragmentation (INFO memory's
used_memory minus the keys).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TypeVar

# Bytes an entry costs in the store with the bound's bookkeeping, at 100,000 entries (measured:
# bench/results/store_index_bound.json): the prior until the store's own figure is known.
PRIOR_BYTES_PER_ENTRY = 163.0
# A sample smaller than this says more about per-key overhead than about entries: not used.
MIN_SAMPLE_ENTRIES = 1_000
# Namespaces measured per calibration: the largest half, the rest at random.
SAMPLE_NAMESPACES = 6
# MEMORY USAGE's SAMPLES: elements looked at per key (0 would walk every one, blocking the store).
MEMORY_SAMPLES = 16
# Every per-namespace key of the index (broker/fleet/index.py, index_bound.py).
NAMESPACE_KEYS = ("ix", "lru", "slot", "slotof", "cnt", "seq", "tick")

# The share of a bytes budget the layouts' mirror change streams may take together.
STREAM_SHARE = 0.125

T = TypeVar("T")


def entry_bound(budget_bytes: int, bytes_per_entry: float) -> int:
    """The most entries `budget_bytes` holds at `bytes_per_entry` (at least 1)."""
    return max(1, int(budget_bytes // max(bytes_per_entry, 1.0)))


def sample_namespaces(sizes: Sequence[tuple[int, T]], k: int, rng: random.Random) -> list[tuple[int, T]]:
    """Up to `k` of (entries, namespace): the largest k/2 (where most entries are) and the rest at
    random among the others (so many small namespaces, with their per-key overhead, count too)."""
    nonempty = sorted((s for s in sizes if s[0] > 0), key=lambda s: s[0], reverse=True)
    largest, others = nonempty[: (k + 1) // 2], nonempty[(k + 1) // 2 :]
    return largest + rng.sample(others, min(len(others), k - len(largest)))


class StoreEntryBytes:
    """The store's bytes per index entry, measured with `memory_usage(key)` (MEMORY USAGE)."""

    def __init__(self, budget_bytes: int, seed: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.per_entry = PRIOR_BYTES_PER_ENTRY
        self.measured = False  # whether per_entry is the store's figure (else the prior)
        self.beside_bytes = 0  # the store's bytes of the mirror change streams, last measured
        self.streams = 1  # the layouts' streams the share is split between
        self._rng = random.Random(seed)

    @property
    def stream_budget(self) -> int:
        """The bytes the mirror change streams may take together."""
        return int(self.budget_bytes * STREAM_SHARE)

    @property
    def stream_bytes(self) -> int:
        """The bytes one layout's stream may take."""
        return self.stream_budget // self.streams

    @property
    def bound(self) -> int:
        beside = max(self.beside_bytes, self.stream_budget)
        return entry_bound(max(0, self.budget_bytes - beside), self.per_entry)

    def measure_beside(
        self, streams: Sequence[Sequence[str]], memory_usage: Callable[[str], int | None]
    ) -> None:
        """The bytes of the mirror change streams (each layout's keys): what the entries' share gives
        way to past the streams' own share, and how many streams share it."""
        self.beside_bytes = sum(int(memory_usage(key) or 0) for keys in streams for key in keys)
        self.streams = max(1, len(streams))

    def calibrate(
        self,
        sizes: Sequence[tuple[int, str]],
        keys_of: Callable[[str], list[str]],
        memory_usage: Callable[[str], int | None],
    ) -> bool:
        """Measure the namespaces `sizes` ((entries, namespace id)) samples; True if the figure was
        replaced. `keys_of(nsid)` names a namespace's keys, `memory_usage(key)` asks the store."""
        sample = sample_namespaces(sizes, SAMPLE_NAMESPACES, self._rng)
        entries = sum(n for n, _ in sample)
        if entries < MIN_SAMPLE_ENTRIES:
            return False
        used = sum(int(memory_usage(key) or 0) for _, nsid in sample for key in keys_of(nsid))
        if used <= 0:
            return False
        self.per_entry, self.measured = used / entries, True
        return True
