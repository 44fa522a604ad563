"""The Redis lease table's weak cache of Lease objects: a caller holding a Lease finds it again
(and sees it refreshed in place), and the entries of leases nobody holds any more do not pile up."""

from __future__ import annotations

import gc
from array import array

from kvbroker.broker.fleet.leases import _WeakLeases
from kvbroker.broker.leases import Lease
from kvbroker.common.model import LeaseState, Namespace, Tier


def _lease(i: int) -> Lease:
    return Lease(
        f"l{i}", "P", "D", Namespace("x", ""), Tier.GPU, array("Q"), array("I"), LeaseState.HELD, 1.0, 1.0
    )


def test_held_leases_are_found_and_dropped_ones_are_swept() -> None:
    cache = _WeakLeases()
    held = [_lease(i) for i in range(10)]
    for lease in held:
        cache[lease.lease_id] = lease
    for i in range(10, 5_000):
        cache[f"l{i}"] = _lease(i)  # dropped at once: nobody holds it
    gc.collect()
    assert all(cache.get(lease.lease_id) is lease for lease in held)
    assert cache.get("l4999") is None and cache.get("nope") is None
    assert len(cache) < 2_100  # swept whenever it doubled, not 5,000 entries
