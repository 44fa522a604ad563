"""How exact the broker's picture of each engine's blocks is.

- **exact**: every store and eviction applied in order. A connector engine
  announces and evicts over its own ordered session stream; a KV-event feed
  is exact while its sequence numbers have no gap.
- **lagging**: a KV-event feed saw a gap in the sequence numbers and is
  replaying the missed batches from the publisher (broker/indexer/kv_events.py):
  entries may be missing or stale until the replay ends.
- **degraded**: events were lost for good (a gap with no replay endpoint, or
  one the replay could not fill), or a connector engine has been silent for
  two heartbeat intervals (a frozen host's announces and evictions are not
  arriving): entries may name blocks the engine no longer has. A feed's
  AllBlocksCleared, or its publisher reconnecting, makes it exact again (the
  picture restarts from nothing); a silent engine is exact again with its
  next message.

A lost feed (its publisher's connection dropped) ends the engine's record
altogether: nothing is named for it then.

Resolve, Score, ListEngines, the indexer's ``/workers`` and the metrics carry
the state; ``require_exact`` on Resolve and Score leaves out engines that are
not exact, as if they held nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from enum import IntEnum

from kvbroker.broker.registry import EngineRecord


class Exactness(IntEnum):
    """Values equal to the wire's IndexExactness."""

    EXACT = 1
    LAGGING = 2
    DEGRADED = 3

    @property
    def label(self) -> str:
        return self.name.lower()


# A connector engine sends a heartbeat every third of its session TTL; silent for two of them
# (two thirds of the TTL), its announces and evictions are not arriving either.
SILENT_FRACTION = 2 / 3


def exactness_of(rec: EngineRecord, now: float) -> tuple[Exactness, str]:
    """The engine's state now, and why it is not exact ("" when it is)."""
    if rec.exactness != Exactness.EXACT:
        return Exactness(rec.exactness), rec.exactness_reason
    # Another replica's engine has no local deadline (0): its owner judges its silence.
    if rec.deadline > 0 and rec.ttl_s > 0:
        silent_s = now - (rec.deadline - rec.ttl_s)
        if silent_s > rec.ttl_s * SILENT_FRACTION:
            return Exactness.DEGRADED, f"silent for {silent_s:.1f} s (session TTL {rec.ttl_s:.1f} s)"
    return Exactness.EXACT, ""


def score_candidates(
    records: Iterable[EngineRecord], now: float
) -> tuple[dict[str, tuple[float, bool]], dict[str, Exactness]]:
    """Score's candidates (engine id -> (load, draining)) and each one's exactness."""
    engines: dict[str, tuple[float, bool]] = {}
    states: dict[str, Exactness] = {}
    for rec in records:
        engines[rec.engine_id] = (rec.load, rec.draining)
        states[rec.engine_id] = exactness_of(rec, now)[0]
    return engines, states


def exact_only(
    prefixes: Sequence[tuple[str, object, int]], states: dict[str, Exactness], require_exact: bool
) -> list[tuple[str, object, int]]:
    """Index lookups of engines whose entries may be counted (all of them unless exact is required)."""
    if not require_exact:
        return list(prefixes)
    return [p for p in prefixes if states.get(p[0]) is Exactness.EXACT]


def census(records: Iterable[EngineRecord], now: float) -> dict[str, int]:
    """Engines per state, every state present (for /metrics)."""
    counts = Counter(exactness_of(rec, now)[0].label for rec in records)
    return {state.label: counts.get(state.label, 0) for state in Exactness}
