"""Who holds a prefix: the engines resolve may name, best first, each with the hold
that already covers what it would read (a reader claims that hold instead of a pin).

A read-only answer: advice until the core turns it into a lease.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbroker.broker.exactness import Exactness, exactness_of
from kvbroker.broker.leases import Lease, LeaseTable
from kvbroker.broker.observed import ObservedIndex, ObservedRegistry
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.model import LeaseState, Namespace, is_event_fed
from kvbroker.common.scoring import HolderMatch, rank_holders


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def find_holders(
    index: ObservedIndex,
    registry: ObservedRegistry,
    leases: LeaseTable,
    asker: EngineRecord | None,
    ns: Namespace,
    hashes: Sequence[int],
    now: float = 0.0,
    require_exact: bool = False,
) -> list[HolderMatch]:
    """Ready, serving engines whose blocks `asker` can read, ranked; never `asker` itself, never an
    event-fed engine (broker/indexer/kv_events.py); with `require_exact` only those whose entries
    are exact as of `now` (broker/exactness.py)."""
    matches: list[HolderMatch] = []
    for engine_id, tier, n in index.longest_prefixes(ns, hashes):
        rec = registry.find(engine_id)
        if rec is None or rec is asker or rec.draining or not rec.ready:
            continue
        if is_event_fed(rec.info.labels):
            continue  # known from its KV events only: it holds no leases, nobody pulls from it
        if asker is not None and registry.incompatibility(asker, rec) is not None:
            continue
        exactness = exactness_of(rec, now)[0]
        if require_exact and exactness is not Exactness.EXACT:
            continue
        matches.append(HolderMatch(engine_id, tier, n, rec.load, exactness=int(exactness)))
    reader = asker.engine_id if asker is not None else ""
    for m in matches:
        hold, m.reads = covering_hold(leases, m, ns, hashes, reader)
        if hold is not None:
            m.hold_lease_id = hold.lease_id
            # A hold pins its blocks, so all it covers is held, announced yet or not:
            # its holder announces them once granted, and a prompt's partial last block
            # (held for a P -> D handover) is announced by no cache event at all.
            m.matched = max(m.matched, common_prefix(hold.block_hashes, hashes))
    # Ranked once the holds are known: a hold makes a busy holder's GPU copy ready to read.
    return rank_holders(matches) if len(matches) > 1 else matches


def covering_hold(
    leases: LeaseTable, m: HolderMatch, ns: Namespace, hashes: Sequence[int], reader: str
) -> tuple[Lease | None, int]:
    """The holder's unclaimed hold, open to `reader`, with the longest prefix covering the match;
    and how many of the holder's leases of that tier are being read now (from the same walk)."""
    best: Lease | None = None
    best_len = 0
    reads = 0
    for lease in leases.by_holder(m.engine_id):
        if lease.state is LeaseState.ACTIVE and lease.tier == m.tier and lease.reader:  # not a retention
            reads += 1
        elif (
            lease.state is LeaseState.HELD
            and lease.tier == m.tier
            and lease.namespace == ns
            and lease.reader in ("", reader)
        ):
            n = common_prefix(lease.block_hashes, hashes)
            if n >= m.matched and n > best_len:
                best, best_len = lease, n
    return best, reads
