"""Watch events and mirror changes at the core: which ones, with what, in which order.

Watchers and mirrors see a change only through these streams, so their order is part
of the API: a lease revoked because its holder left comes before `engine_gone`, blocks
dropped under a lease revoke it before `blocks_removed`, an engine gone from a mirror
comes before its blocks are stored again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.core import BrokerCore
from kvbroker.broker.errors import FailedPrecondition
from kvbroker.broker.events import WatchEvent
from kvbroker.broker.mirror import MirrorSubscriber
from kvbroker.broker.registry import EngineRecord
from kvbroker.common.model import Namespace, Tier
from testkit.builders import engine_info
from testkit.clock import FakeClock
from tests.broker.helpers import RecordingNotifier

H = list(range(500, 516))
Seen = tuple[str, str, str, str, int, int, str]


@dataclass
class SnapshotNotifier(RecordingNotifier):
    """Records each watch event as it is when sent (its lease changes later)."""

    seen: list[Seen] = field(default_factory=list)

    def event(self, event: WatchEvent) -> None:
        lease = event.lease
        state = f"{lease.state.label}/{lease.cause.label}" if lease is not None else ""
        tier = int(event.tier or 0)
        self.seen.append(
            (event.category, event.kind, event.engine_id, state, event.blocks, tier, event.detail)
        )


def setup() -> tuple[
    BrokerCore, FakeClock, SnapshotNotifier, EngineRecord, EngineRecord, Namespace, MirrorSubscriber
]:
    """Engines P and D registered, watched and mirrored from the start."""
    clock, notes = FakeClock(), SnapshotNotifier()
    core = BrokerCore(BrokerConfig(), clock=clock, notifier=notes)
    probe = core.register(engine_info("probe"), 0)
    core.end_session(probe.session_id)
    sub = core.mirrors.subscribe(probe.layout_id, lambda: None)
    notes.seen.clear()
    p = core.register(engine_info("P"), 3000)
    d = core.register(engine_info("D"), 3000)
    return core, clock, notes, p, d, Namespace(p.layout_id, ""), sub


def mirror_log(sub: MirrorSubscriber) -> list[str]:
    out = []
    for update in sub.take():
        for e in update.engines:
            out.append(
                f"engine {e.engine.engine_id} {'gone' if e.gone else 'draining' if e.engine.draining else 'up'}"
            )
        for b in update.blocks:
            if b.clear_tier:
                out.append(f"clear {b.engine_id} tier{b.tier}")
            else:
                out.append(f"blocks {b.engine_id} tier{b.tier} +{list(b.stored)} -{list(b.removed)}")
    return out


def test_inventory_events_follow_the_revocations_they_cause() -> None:
    core, _clock, notes, p, _d, ns, sub = setup()
    core.update_inventory(p, ns, Tier.GPU, H[:4], [])
    core.hold("P", ns, Tier.GPU, H[:2], [1, 2], reader_id="D")
    core.hold("P", ns, Tier.GPU, H[2:4], [3, 4])
    core.update_inventory(p, ns, Tier.GPU, H[4:6], [H[0]])
    core.update_inventory(p, ns, Tier.GPU, [], [], clear_all=True)
    core.update_inventory(p, ns, Tier.CPU, H[:1], [])
    assert notes.seen == [
        ("engine", "engine_registered", "P", "", 0, 0, p.layout_id),
        ("engine", "engine_registered", "D", "", 0, 0, p.layout_id),
        ("index", "blocks_stored", "P", "", 4, 1, ""),
        ("lease", "lease_held", "P", "held/none", 0, 0, ""),
        ("lease", "lease_held", "P", "held/none", 0, 0, ""),
        ("lease", "lease_revoked", "P", "revoked/superseded", 0, 0, "superseded"),
        ("index", "blocks_removed", "P", "", 1, 1, ""),
        ("index", "blocks_stored", "P", "", 2, 1, ""),
        ("lease", "lease_revoked", "P", "revoked/superseded", 0, 0, "superseded"),
        ("index", "tier_cleared", "P", "", 5, 1, ""),
        ("index", "blocks_stored", "P", "", 1, 2, ""),
    ]
    assert mirror_log(sub) == [
        "engine P up",
        "engine D up",
        f"blocks P tier1 +{H[:4]} -[]",
        f"blocks P tier1 +[] -{[H[0]]}",
        f"blocks P tier1 +{H[4:6]} -[]",
        "clear P tier1",
        f"blocks P tier2 +{H[:1]} -[]",
    ]


def test_lease_life_cycle_events() -> None:
    core, clock, notes, p, d, ns, _sub = setup()
    core.update_inventory(p, ns, Tier.GPU, H, [])
    notes.seen.clear()
    pending = core.resolve(d, ns, H[:4], acquire=True).lease
    assert pending is not None
    core.pin_result(p, pending.lease_id, True, [1, 2, 3, 4], "")
    core.release(pending.lease_id, "D", pending.epoch)
    refused = core.resolve(d, ns, H[:4], acquire=True).lease
    assert refused is not None
    core.pin_result(p, refused.lease_id, False, [], "no room")
    hold = core.hold("P", ns, Tier.GPU, H[:8], list(range(8)), reader_id="D")
    claimed = core.resolve(d, ns, H[:8], acquire=True).lease
    assert claimed is hold
    held = core.hold("P", ns, Tier.CPU, H[:2], [1, 2], ttl_ms=1000)
    core.acquire(held.lease_id, "D", 1000)
    core.hold("P", ns, Tier.CPU, H[2:4], [3, 4], ttl_ms=1000)
    clock.advance(2.0)
    with pytest.raises(FailedPrecondition, match="ttl_expired"):
        core.renew(held.lease_id, "D")  # finds the TTL passed: revoked there and then
    core.heartbeat(p, 0.0)
    core.heartbeat(d, 0.0)
    core.expire()
    assert notes.seen == [
        ("lease", "lease_pending", "P", "pending/none", 0, 0, ""),
        ("lease", "lease_active", "P", "active/none", 0, 0, ""),
        ("lease", "lease_released", "P", "released/none", 0, 0, ""),
        ("lease", "lease_pending", "P", "pending/none", 0, 0, ""),
        ("lease", "lease_revoked", "P", "revoked/holder_refused", 0, 0, "holder_refused"),
        ("lease", "lease_held", "P", "held/none", 0, 0, ""),
        ("lease", "lease_active", "P", "active/none", 0, 0, ""),
        ("lease", "lease_held", "P", "held/none", 0, 0, ""),
        ("lease", "lease_active", "P", "active/none", 0, 0, ""),
        ("lease", "lease_held", "P", "held/none", 0, 0, ""),
        ("lease", "lease_revoked", "P", "revoked/ttl_expired", 0, 0, "ttl_expired"),
        ("lease", "lease_revoked", "P", "revoked/ttl_expired", 0, 0, "ttl_expired"),
    ]


def test_engine_events_come_after_the_revocations_they_cause() -> None:
    core, clock, notes, p, _d, ns, sub = setup()
    core.update_inventory(p, ns, Tier.GPU, H[:2], [])
    core.hold("P", ns, Tier.GPU, H[:1], [1], reader_id="D")
    core.hold("D", ns, Tier.GPU, H[:1], [1], reader_id="P")
    core.drain("P", "maintenance")
    clock.advance(0.5)  # the new D's session ends after P's
    core.register(engine_info("D"), 3000)  # supersedes D's session
    rank = core.register(engine_info("R", ranks=False), 3000, expected_ranks=1)
    core.register_rank("R", engine_info("R").ranks[0])
    r_lease = core.hold("R", ns, Tier.GPU, H[:1], [1])
    core.revoke(r_lease.lease_id)
    clock.advance(3.2)
    core.heartbeat(rank, 0.0)
    core.expire()
    assert notes.seen == [
        ("engine", "engine_registered", "P", "", 0, 0, p.layout_id),
        ("engine", "engine_registered", "D", "", 0, 0, p.layout_id),
        ("index", "blocks_stored", "P", "", 2, 1, ""),
        ("lease", "lease_held", "P", "held/none", 0, 0, ""),
        ("lease", "lease_held", "D", "held/none", 0, 0, ""),
        ("lease", "lease_revoked", "P", "revoked/drain", 0, 0, "drain"),
        ("engine", "engine_draining", "P", "", 0, 0, "maintenance"),
        ("lease", "lease_revoked", "D", "revoked/holder_gone", 0, 0, "holder_gone"),
        ("engine", "engine_gone", "D", "", 0, 0, "superseded: the engine registered a new session"),
        ("engine", "engine_registered", "D", "", 0, 0, p.layout_id),
        ("engine", "engine_registered", "R", "", 0, 0, p.layout_id),
        ("lease", "lease_held", "R", "held/none", 0, 0, ""),
        ("lease", "lease_revoked", "R", "revoked/operator", 0, 0, "operator"),
        ("engine", "engine_gone", "P", "", 0, 0, "session TTL of 3000 ms passed without a heartbeat"),
        ("engine", "engine_gone", "D", "", 0, 0, "session TTL of 3000 ms passed without a heartbeat"),
    ]
    assert mirror_log(sub) == [
        "engine P up",
        "engine D up",
        f"blocks P tier1 +{H[:2]} -[]",
        "engine P draining",
        "engine D gone",
        "engine D up",
        "engine R up",
        "engine P gone",
        "engine D gone",
    ]
