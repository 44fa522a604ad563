"""Pure functions that order lookup results: for resolve (holders) and for routers (engines)."""

from __future__ import annotations

from dataclasses import dataclass

from kvbroker.common.model import Tier

# A load change is material when it moves by at least this fraction of the larger
# figure, and by at least this fraction of 1 (so 0 -> 1 request, 3 -> 4 and 10 -> 12
# are material, 10 -> 11 is not): the threshold for republishing an engine to mirrors
# and for an engine's early heartbeat.
LOAD_STEP = 0.1


def load_changed(old: float, new: float) -> bool:
    """Whether a holder's load moved enough for readers to hear of it before the next heartbeat."""
    return abs(new - old) >= LOAD_STEP * max(1.0, old, new)


@dataclass(slots=True)
class HolderMatch:
    engine_id: str
    tier: Tier
    matched: int
    load: float
    hold_lease_id: str = ""
    reads: int = 0  # leases on the holder's blocks of this tier being read now (ACTIVE)
    exactness: int = 1  # IndexExactness of the broker's picture of this holder (1: exact)


# A holder with at least this load (requests its scheduler has taken up and not finished) is
# stepping: a pin of its GPU copy waits for its scheduler's current step to end (hundreds of
# milliseconds for a prefill chunk on a busy engine), while its CPU tier pins at once.
BUSY_LOAD = 1.0


def waits_on_step(m: HolderMatch) -> bool:
    """Whether reading this match needs the holder's scheduler to pin it first while that scheduler
    is busy: a GPU copy with no hold already covering it, on a holder with a load of BUSY_LOAD+."""
    return m.tier == Tier.GPU and not m.hold_lease_id and m.load >= BUSY_LOAD


def rank_holders(matches: list[HolderMatch]) -> list[HolderMatch]:
    """Best first: longest prefix; then a copy that is ready to read before one whose pin waits on a
    busy holder's step (so a busy holder's CPU copy comes before its GPU copy, unless a hold
    already pins the GPU one); then GPU before CPU; then lower load."""
    return sorted(matches, key=lambda m: (-m.matched, waits_on_step(m), m.tier, m.load, m.engine_id))


@dataclass(slots=True)
class EngineScore:
    engine_id: str
    gpu_blocks: int
    cpu_blocks: int
    load: float
    draining: bool
    exactness: int = 1  # IndexExactness of the counts above (1: exact)


def score_engines(
    prefixes: list[tuple[str, Tier, int]], engines: dict[str, tuple[float, bool]]
) -> list[EngineScore]:
    """One score per candidate engine (engine_id -> (load, draining)) from index lookups.

    Best first: not draining, longest prefix on any tier, more of it on GPU, lower load.
    """
    gpu: dict[str, int] = {}
    cpu: dict[str, int] = {}
    for engine_id, tier, matched in prefixes:
        if engine_id in engines:
            (gpu if tier is Tier.GPU else cpu)[engine_id] = matched
    scores = [
        EngineScore(e, gpu.get(e, 0), cpu.get(e, 0), load, draining)
        for e, (load, draining) in engines.items()
    ]
    scores.sort(
        key=lambda s: (s.draining, -max(s.gpu_blocks, s.cpu_blocks), -s.gpu_blocks, s.load, s.engine_id)
    )
    return scores
