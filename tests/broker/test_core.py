"""Unit tests of the domain core with a fake clock (no network, no sleeping)."""

from __future__ import annotations

import pytest

from kvbroker.broker.errors import FailedPrecondition, InvalidArgument, NotFound, OutOfRange, PermissionDenied
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier
from testkit.builders import engine_info
from tests.broker.helpers import make_core

H = list(range(1000, 1064))  # a 64-block chain


def setup_pair(**config: object):
    core, clock, notes = make_core(**config)
    p = core.register(engine_info("P"), 3000)
    d = core.register(engine_info("D"), 3000)
    ns = Namespace(p.layout_id, "")
    return core, clock, notes, p, d, ns


def test_register_negotiates_ttl_and_rejects_out_of_range():
    core, _clock, _ = make_core(session_ttl_min_ms=500, session_ttl_max_ms=5000)
    assert core.register(engine_info("A"), 0).ttl_s == core.config.session_ttl_ms / 1000
    with pytest.raises(OutOfRange, match=r"\[500, 5000\]"):
        core.register(engine_info("B"), 100)
    with pytest.raises(InvalidArgument, match="block_size"):
        core.register(engine_info("C", block_size=0), 0)


def test_session_expiry_revokes_both_sides_and_stops_naming():
    core, clock, notes, p, d, ns = setup_pair()
    core.update_inventory(p, ns, Tier.GPU, H, [])
    lease = core.hold("P", ns, Tier.GPU, H[:4], [1, 2, 3, 4], 10_000, reader_id="D")
    core.acquire(lease.lease_id, "D", 10_000)
    clock.advance(2.0)
    core.heartbeat(d, 0.0)  # D stays alive, P goes silent
    clock.advance(1.5)
    core.expire()
    assert lease.state is LeaseState.REVOKED and lease.cause is RevokeCause.HOLDER_GONE
    assert [s.lease for s in notes.to(d.session_id, "revoked")] == [lease]
    assert notes.to(p.session_id, "close")[0].detail == "DEADLINE_EXCEEDED"
    assert core.resolve(d, ns, H).matches == []
    with pytest.raises(NotFound):
        core.registry.get("P")


def test_reader_session_end_revokes_and_tells_holder():
    core, _clock, notes, p, d, ns = setup_pair()
    lease = core.hold("P", ns, Tier.GPU, H[:2], [7, 8], reader_id="D")
    core.end_session(d.session_id)
    assert lease.cause is RevokeCause.READER_GONE
    assert [s.lease for s in notes.to(p.session_id, "ended")] == [lease]
    assert notes.to(d.session_id, "revoked") == []  # the reader is gone; no one to tell


def test_renew_only_extends():
    core, clock, _n, _p, _d, ns = setup_pair()
    lease = core.hold("P", ns, Tier.GPU, H[:1], [1], 10_000)
    deadline = lease.deadline
    core.renew(lease.lease_id, "P", 1000)
    assert lease.deadline == deadline
    clock.advance(5)
    core.renew(lease.lease_id, "P", 20_000)
    assert lease.deadline == clock.now() + 20
    with pytest.raises(PermissionDenied):
        core.renew(lease.lease_id, "D", 1000)


def test_ttl_expiry_and_release_after_revoke_fails_with_cause():
    core, clock, notes, p, d, ns = setup_pair()
    lease = core.hold("P", ns, Tier.GPU, H[:2], [1, 2], 1000)
    core.acquire(lease.lease_id, "D", 1000)
    clock.advance(1.01)
    # Not yet swept by the expiry loop: release must still see the expiry.
    with pytest.raises(FailedPrecondition, match="ttl_expired") as exc:
        core.release(lease.lease_id, "D")
    assert exc.value.cause == "ttl_expired"
    assert notes.to(d.session_id, "revoked")[0].lease is lease
    assert notes.to(p.session_id, "ended")[0].lease is lease
    assert core.stats().revocations_by_cause["ttl_expired"] == 1


def test_release_commits_read_and_holder_is_told():
    core, _clock, notes, p, _d, ns = setup_pair()
    lease = core.hold("P", ns, Tier.GPU, H[:2], [1, 2])
    with pytest.raises(FailedPrecondition, match="held"):
        core.release(lease.lease_id, "D")  # not yet acquired
    core.acquire(lease.lease_id, "D")
    with pytest.raises(PermissionDenied):
        core.release(lease.lease_id, "P")
    with pytest.raises(FailedPrecondition, match="epoch"):
        core.release(lease.lease_id, "D", epoch=lease.epoch + 5)
    core.release(lease.lease_id, "D", epoch=lease.epoch)
    assert lease.state is LeaseState.RELEASED
    assert notes.to(p.session_id, "ended")[0].lease is lease
    with pytest.raises(FailedPrecondition, match="already released"):
        core.release(lease.lease_id, "D")
    with pytest.raises(NotFound):
        core.release("nope", "D")


def test_namespace_isolation():
    core, _clock, _n, p, d, ns = setup_pair()
    core.update_inventory(p, Namespace(ns.layout_id, "tenant-a"), Tier.GPU, H, [])
    assert core.resolve(d, Namespace(ns.layout_id, "tenant-b"), H).matches == []
    assert core.resolve(d, Namespace(ns.layout_id, "tenant-a"), H).matches[0].matched == 64
    with pytest.raises(FailedPrecondition, match="layout"):
        core.resolve(d, Namespace("other-layout", "tenant-a"), H)
    with pytest.raises(InvalidArgument, match="layout_id is empty"):
        core.resolve(d, Namespace("", "tenant-a"), H)


def test_longest_prefix_per_holder_and_tier_best_first():
    core, _clock, _n, p, d, ns = setup_pair()
    x = core.register(engine_info("X"), 3000)
    core.update_inventory(p, ns, Tier.GPU, H[:10], [])
    core.update_inventory(p, ns, Tier.CPU, H[:40], [])
    core.update_inventory(x, ns, Tier.GPU, H[:40], [])
    core.update_inventory(x, ns, Tier.CPU, H[1:64], [])  # no block 0: no prefix
    got = [(m.engine_id, m.tier, m.matched) for m in core.resolve(d, ns, H).matches]
    assert got == [("X", Tier.GPU, 40), ("P", Tier.CPU, 40), ("P", Tier.GPU, 10)]
    # Never the asking engine itself.
    assert all(m.engine_id != "X" for m in core.resolve(x, ns, H).matches)
    # Removing a middle block cuts the prefix there.
    core.update_inventory(x, ns, Tier.GPU, [], [H[5]])
    assert core.resolve(d, ns, H).matches[0].engine_id == "P"
    assert ("X", Tier.GPU, 5) in [(m.engine_id, m.tier, m.matched) for m in core.resolve(d, ns, H).matches]


def test_a_busy_holders_cpu_copy_comes_before_its_gpu_copy_unless_a_hold_covers_it():
    """A pin of a busy holder's GPU copy waits for its scheduler's step; its CPU tier pins at once."""
    core, _clock, _n, p, d, ns = setup_pair()
    core.update_inventory(p, ns, Tier.GPU, H[:20], [])
    core.update_inventory(p, ns, Tier.CPU, H[:20], [])

    def order() -> list[tuple[str, Tier, int]]:
        return [(m.engine_id, m.tier, m.matched) for m in core.resolve(d, ns, H).matches]

    assert order() == [("P", Tier.GPU, 20), ("P", Tier.CPU, 20)], "an idle holder: GPU first"
    core.heartbeat(p, 2.0)
    assert order() == [("P", Tier.CPU, 20), ("P", Tier.GPU, 20)], "a busy holder: its CPU copy first"
    # A longer prefix still wins: the CPU copy is preferred among equals only.
    core.update_inventory(p, ns, Tier.GPU, H[20:24], [])
    assert order()[0] == ("P", Tier.GPU, 24)
    # A hold of the GPU copy for this reader is pinned already: no step to wait for.
    core.update_inventory(p, ns, Tier.GPU, [], H[20:24])
    core.hold("P", ns, Tier.GPU, H[:20], list(range(20)), reader_id="D")
    matches = core.resolve(d, ns, H).matches
    assert [(m.tier, bool(m.hold_lease_id)) for m in matches] == [(Tier.GPU, True), (Tier.CPU, False)]
    # An idle engine's GPU copy of as much comes before a busy holder's CPU copy.
    x = core.register(engine_info("X"), 3000)
    core.update_inventory(x, ns, Tier.GPU, H[:20], [])
    assert core.resolve(d, ns, H).matches[0].engine_id == "X"


def test_resolve_acquire_claims_covering_hold():
    core, _clock, notes, p, d, ns = setup_pair()
    core.update_inventory(p, ns, Tier.GPU, H[:8], [])
    hold = core.hold("P", ns, Tier.GPU, H[:8], list(range(8)))
    res = core.resolve(d, ns, H, acquire=True)
    assert not res.pending and res.lease is hold
    assert hold.state is LeaseState.ACTIVE and hold.reader == "D" and list(hold.block_ids) == list(range(8))
    assert res.holder is not None and res.holder.engine_id == "P"
    assert notes.to(p.session_id, "pin") == []


def test_a_hold_covers_what_its_holder_has_not_announced_yet():
    # P's cache events announced 3 blocks; its hold also pins a 4th (the prompt's partial last
    # block, which no cache event announces): a reader is told the hold's whole prefix.
    core, _clock, _notes, p, d, ns = setup_pair()
    tail = 987654321
    core.update_inventory(p, ns, Tier.GPU, H[:3], [])
    hold = core.hold("P", ns, Tier.GPU, [*H[:3], tail], [1, 2, 3, 4], reader_id="D", request_id="p1")
    (match,) = core.resolve(d, ns, [*H[:3], tail]).matches
    assert (match.engine_id, match.matched, match.hold_lease_id) == ("P", 4, hold.lease_id)
    # Another prompt that shares only the full blocks is told those.
    (other,) = core.resolve(d, ns, [*H[:3], tail + 1]).matches
    assert other.matched == 3
    # Once the hold ends, the index alone answers.
    core.decline("P", "p1", "not needed")
    assert hold.state is LeaseState.REVOKED
    (after,) = core.resolve(d, ns, [*H[:3], tail]).matches
    assert (after.matched, after.hold_lease_id) == (3, "")


def test_resolve_acquire_pin_flow_ok_refused_and_timeout():
    core, clock, notes, p, d, ns = setup_pair(pin_timeout_ms=500)
    core.update_inventory(p, ns, Tier.GPU, H[:8], [])
    res = core.resolve(d, ns, H, acquire=True, min_blocks=4)
    assert res.pending and res.lease is not None and res.lease.state is LeaseState.PENDING
    pin = notes.to(p.session_id, "pin")[0].lease
    assert pin is res.lease and list(pin.block_hashes) == H[:8]
    with pytest.raises(InvalidArgument, match="parallel"):
        core.pin_result(p, pin.lease_id, True, [1], "")
    core.pin_result(p, pin.lease_id, True, list(range(8)), "")
    assert pin.state is LeaseState.ACTIVE and notes.settled == [pin]
    # Refused.
    res2 = core.resolve(d, ns, H, acquire=True)
    assert res2.lease is not None
    core.pin_result(p, res2.lease.lease_id, False, [], "no room")
    assert res2.lease.cause is RevokeCause.HOLDER_REFUSED and notes.settled[-1] is res2.lease
    # Not answered in time.
    res3 = core.resolve(d, ns, H, acquire=True)
    clock.advance(0.6)
    core.expire()
    assert res3.lease is not None and res3.lease.cause is RevokeCause.HOLDER_REFUSED
    assert "in time" in res3.lease.detail
    # Below min_blocks: no lease.
    assert core.resolve(d, ns, H, acquire=True, min_blocks=9).skipped_reason == "below_min"


def test_held_lease_revoked_when_named_reader_leaves():
    core, _clock, notes, p, d, ns = setup_pair()
    hold = core.hold("P", ns, Tier.GPU, H[:2], [1, 2], reader_id="D")
    core.end_session(d.session_id)
    assert hold.state is LeaseState.REVOKED and hold.cause is RevokeCause.READER_GONE
    assert notes.to(p.session_id, "ended")[0].lease is hold


def test_drain_stops_naming_and_revokes_unclaimed_holds():
    core, _clock, notes, p, d, ns = setup_pair()
    core.update_inventory(p, ns, Tier.GPU, H[:4], [])
    unclaimed = core.hold("P", ns, Tier.GPU, H[:4], [1, 2, 3, 4])
    claimed = core.hold("P", ns, Tier.GPU, H[:4], [1, 2, 3, 4], reader_id="D")
    core.acquire(claimed.lease_id, "D")
    assert core.drain("P", "maintenance") == 1
    assert unclaimed.cause is RevokeCause.DRAIN and claimed.state is LeaseState.ACTIVE
    assert notes.to(p.session_id, "drain")[0].detail == "maintenance"
    assert core.resolve(d, ns, H).matches == []
    with pytest.raises(FailedPrecondition, match="draining"):
        core.hold("P", ns, Tier.GPU, H[:1], [1])


def test_reregister_ends_old_session():
    core, _clock, notes, p, d, ns = setup_pair()
    core.update_inventory(p, ns, Tier.GPU, H, [])
    lease = core.hold("P", ns, Tier.GPU, H[:1], [1], reader_id="D")
    p2 = core.register(engine_info("P"), 3000)
    assert p2.session_id != p.session_id
    assert notes.to(p.session_id, "close")[0].detail == "ABORTED"
    assert lease.cause is RevokeCause.HOLDER_GONE
    assert core.resolve(d, ns, H).matches == []  # the new session announced nothing yet
    # A bad re-registration leaves the live session alone.
    with pytest.raises(InvalidArgument):
        core.register(engine_info("P", head_size=0), 3000)
    assert core.registry.get("P") is p2


def test_removed_blocks_under_lease_supersede_it():
    core, _clock, notes, p, d, ns = setup_pair()
    core.update_inventory(p, ns, Tier.GPU, H[:4], [])
    lease = core.hold("P", ns, Tier.GPU, H[:4], [1, 2, 3, 4], reader_id="D")
    core.acquire(lease.lease_id, "D")
    core.update_inventory(p, ns, Tier.GPU, [], [H[3]])
    assert lease.cause is RevokeCause.SUPERSEDED
    assert notes.to(d.session_id, "revoked")[0].lease is lease


def test_topology_tp_mismatch_is_not_named_and_hold_fails():
    core, _clock, _n, p, _d, ns = setup_pair()
    t2 = core.register(engine_info("T2", tp_size=2), 3000)
    assert t2.layout_id == p.layout_id  # TP is not part of the layout id
    core.update_inventory(p, ns, Tier.GPU, H[:4], [])
    assert core.resolve(t2, ns, H).matches == []
    with pytest.raises(FailedPrecondition, match="tensor-parallel"):
        core.hold("P", ns, Tier.GPU, H[:1], [1], reader_id="T2")


def test_bad_input_errors_name_the_limit():
    core, _clock, _n, p, d, ns = setup_pair(max_hashes=16)
    with pytest.raises(InvalidArgument, match="limit is 16"):
        core.resolve(d, ns, list(range(17)))
    with pytest.raises(OutOfRange, match="lease ttl_ms"):
        core.hold("P", ns, Tier.GPU, H[:1], [1], ttl_ms=10**12)
    with pytest.raises(InvalidArgument, match="parallel"):
        core.hold("P", ns, Tier.GPU, H[:2], [1])
    with pytest.raises(InvalidArgument, match="tier"):
        core.update_inventory(p, ns, 0, H[:1], [])
    with pytest.raises(NotFound, match="unknown engine"):
        core.hold("ghost", ns, Tier.GPU, H[:1], [1])
    with pytest.raises(InvalidArgument, match="acquire needs a reader"):
        core.resolve(None, ns, H[:4], acquire=True)


def test_score_by_hashes_orders_candidates():
    core, _clock, _n, p, d, ns = setup_pair()
    core.update_inventory(p, ns, Tier.GPU, H[:10], [])
    core.update_inventory(d, ns, Tier.CPU, H[:30], [])
    res = core.score(ns, H, [], [])
    assert [(s.engine_id, s.gpu_blocks, s.cpu_blocks) for s in res.scores] == [("D", 0, 30), ("P", 10, 0)]
    assert res.total_blocks == 64 and res.block_size == 32
    with pytest.raises(NotFound):
        core.score(ns, H, [], ["ghost"])
    with pytest.raises(InvalidArgument, match="not both"):
        core.score(ns, H, [1, 2], [])


def test_stats_counts():
    core, _clock, _n, p, _d, ns = setup_pair()
    core.update_inventory(p, ns, Tier.GPU, H, [])
    core.update_inventory(p, ns, Tier.CPU, H[:10], [])
    core.hold("P", ns, Tier.GPU, H[:1], [1])
    st = core.stats()
    assert (st.engines, st.blocks_indexed, st.namespaces) == (2, 74, 1)
    assert st.leases_by_state["held"] == 1
    core.update_inventory(p, ns, Tier.CPU, [], [], clear_all=True)
    assert core.stats().blocks_indexed == 64


def test_decline_ends_an_unclaimed_hold_at_once_and_tells_the_holder():
    core, _clock, notes, p, _d, ns = setup_pair()
    lease = core.hold("P", ns, Tier.GPU, H[:4], [1, 2, 3, 4], 30_000, request_id="req-1")
    other = core.hold("P", ns, Tier.GPU, H[:4], [5, 6, 7, 8], 30_000, request_id="req-2")
    assert core.decline("P", "req-1", "reader D recomputed") is lease
    assert lease.state is LeaseState.REVOKED and lease.cause is RevokeCause.DECLINED
    assert lease.detail == "reader D recomputed"
    assert [s.lease for s in notes.to(p.session_id, "ended")] == [lease]
    assert other.state is LeaseState.HELD  # only the named request's hold
    assert core.decline("P", "req-1") is None  # again: nothing live, no error
    assert core.revocations["declined"] == 1


def test_a_decline_that_comes_before_its_hold_refuses_the_hold():
    core, clock, _notes, _p, _d, ns = setup_pair()
    assert core.decline("P", "req-1", "decode failed") is None
    with pytest.raises(FailedPrecondition, match="declined before its hold arrived") as caught:
        core.hold("P", ns, Tier.GPU, H[:4], [1, 2, 3, 4], 30_000, request_id="req-1")
    assert caught.value.cause == "declined"
    # Refused once; the same request id may hold again later, and a note does not last forever.
    core.hold("P", ns, Tier.GPU, H[:4], [1, 2, 3, 4], 30_000, request_id="req-1")
    core.decline("P", "req-9")
    clock.advance(61.0)
    core.hold("P", ns, Tier.GPU, H[:4], [1, 2, 3, 4], 30_000, request_id="req-9")


def test_decline_leaves_a_claimed_lease_to_its_reader_and_needs_both_names():
    core, _clock, _notes, _p, _d, ns = setup_pair()
    lease = core.hold("P", ns, Tier.GPU, H[:2], [1, 2], 30_000, request_id="req-1")
    core.acquire(lease.lease_id, "D", 10_000)
    with pytest.raises(FailedPrecondition, match="only its reader ends it"):
        core.decline("P", "req-1")
    assert lease.state is LeaseState.ACTIVE
    with pytest.raises(InvalidArgument, match="holder_engine_id and the request_id"):
        core.decline("", "req-1")
    with pytest.raises(InvalidArgument):
        core.decline("P", "")


def test_the_decline_book_is_bounded():
    from kvbroker.broker.declines import DeclineBook

    book = DeclineBook(keep_s=60.0, capacity=3)
    for i in range(10):
        book.add("P", f"r{i}", now=0.0)
    assert len(book) == 3
    assert not book.take("P", "r0", now=1.0) and book.take("P", "r9", now=1.0)
    assert not book.take("P", "r9", now=1.0)  # once


def test_a_stalled_broker_gives_sessions_back_the_time_it_did_not_run():
    core, clock, notes, p, d, _ns = setup_pair()  # session TTL 3 s
    clock.advance(2.0)
    core.heartbeat(d, 0.0)
    # The broker's host starves it for 5 s: P's and D's heartbeats wait unread in its sockets.
    clock.advance(5.0)
    core.forgive_stall(5.0)
    core.expire()
    assert notes.to(p.session_id, "close") == [] and notes.to(d.session_id, "close") == []
    assert core.stalls_forgiven == 1
    # A peer that is really frozen is still caught, over time the broker did run.
    core.heartbeat(d, 0.0)
    clock.advance(2.9)
    core.heartbeat(d, 0.0)
    clock.advance(0.2)
    core.expire()
    assert notes.to(p.session_id, "close")[0].detail == "DEADLINE_EXCEEDED"
    assert notes.to(d.session_id, "close") == []
