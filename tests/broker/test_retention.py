"""Retention (broker/retention.py) on the domain core, with a fake clock: how a retention is
made, how each of its ends comes, and how bad input is refused. The same calls over real gRPC
on every state backend: tests/broker/test_retention_api.py."""

from __future__ import annotations

import pytest

from kvbroker.broker.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    QuotaExceeded,
    ResourceExhausted,
)
from kvbroker.broker.retention import Retention, is_retention
from kvbroker.common.causes import Cause
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier
from testkit.builders import engine_info
from tests.broker.helpers import make_core

H = list(range(5000, 5016))  # a 16-block chain


def setup(**config: object):
    core, clock, notes = make_core(**config)
    p = core.register(engine_info("P"), 3000)
    d = core.register(engine_info("D"), 3000)
    ns = Namespace(p.layout_id, "")
    core.update_inventory(p, ns, Tier.GPU, H[:10], [])
    return core, clock, notes, p, d, ns, Retention(core)


def pinned(core, p, lease):  # type: ignore[no-untyped-def]
    """The holder answers the PinCommand as an engine does."""
    return core.pin_result(p, lease.lease_id, True, list(range(len(lease.block_hashes))), "")


def test_a_retention_is_a_lease_with_no_reader_pinned_by_its_holder():
    core, _clock, notes, p, d, ns, retention = setup()
    done = retention.retain(ns, H, [], 60_000, key="conv-1")
    lease = done.lease
    assert done.pending and done.requested_blocks == 16
    # The held prefix only (10 of 16 blocks), on the engine that holds it, for nobody.
    assert (lease.holder, lease.reader, lease.state) == ("P", "", LeaseState.PENDING)
    assert list(lease.block_hashes) == H[:10] and lease.request_id == "retain:conv-1"
    assert [s.lease for s in notes.to(p.session_id, "pin")] == [lease]
    pinned(core, p, lease)
    assert lease.state is LeaseState.ACTIVE and is_retention(lease)
    assert lease.deadline == pytest.approx(core.clock.now() + 60)
    # A reader is never offered it as a hold to claim, nor counted as a read in flight.
    match = core.resolve(d, ns, H).matches[0]
    assert (match.engine_id, match.hold_lease_id, match.reads) == ("P", "", 0)
    assert retention.count("") == 1


def test_it_ends_at_its_ttl_and_a_later_renewal_says_so():
    core, clock, notes, p, _d, ns, retention = setup()
    lease = retention.retain(ns, H, [], 1_000).lease
    pinned(core, p, lease)
    renewed = retention.retain(ns, [], [], 5_000, lease_id=lease.lease_id).lease
    assert renewed.deadline == pytest.approx(clock.now() + 5)
    clock.advance(2.5)
    core.heartbeat(p, 0.0)  # the holder lives on; only the retention's TTL runs out
    core.expire()
    assert lease.state is LeaseState.ACTIVE
    clock.advance(2.51)
    core.expire()
    assert (lease.state, lease.cause) == (LeaseState.REVOKED, RevokeCause.TTL_EXPIRED)
    assert [s.lease for s in notes.to(p.session_id, "ended")] == [lease]  # the holder unpins
    with pytest.raises(FailedPrecondition, match="ttl_expired") as exc:
        retention.retain(ns, [], [], 5_000, lease_id=lease.lease_id)
    assert exc.value.cause == Cause.TTL_EXPIRED


def test_a_dead_holder_loses_the_pin_and_the_answer_and_the_event_say_so():
    core, _clock, notes, p, _d, ns, retention = setup()
    lease = retention.retain(ns, H, [], 60_000, key="agent-7").lease
    pinned(core, p, lease)
    core.end_session(p.session_id)  # the holder died
    assert lease.cause is RevokeCause.HOLDER_GONE
    revoked = [e for e in notes.events if e.kind == "lease_revoked" and e.lease.lease_id == lease.lease_id]
    assert revoked and revoked[0].lease.request_id == "retain:agent-7"
    with pytest.raises(FailedPrecondition, match="pin is lost") as exc:
        retention.retain(ns, [], [], 60_000, lease_id=lease.lease_id)
    assert exc.value.cause == Cause.HOLDER_GONE


def test_unretain_releases_it_and_the_holder_unpins():
    core, _clock, notes, p, _d, ns, retention = setup()
    lease = retention.retain(ns, H, [], 60_000).lease
    pinned(core, p, lease)
    assert retention.unretain(lease.lease_id).state is LeaseState.RELEASED
    assert [s.lease for s in notes.to(p.session_id, "ended")] == [lease]
    with pytest.raises(FailedPrecondition, match="released"):
        retention.unretain(lease.lease_id)
    # Before the pin: the pending lease ends, and the late pin result changes nothing.
    pending = retention.retain(ns, H, [], 60_000).lease
    assert retention.unretain(pending.lease_id).state is LeaseState.REVOKED
    assert pinned(core, p, pending).state is LeaseState.REVOKED


def test_a_refused_pin_ends_it_as_holder_refused():
    core, _clock, _notes, p, _d, ns, retention = setup()
    lease = retention.retain(ns, H, [], 60_000).lease
    core.pin_result(p, lease.lease_id, False, [], "blocks are no longer cached on GPU")
    assert lease.cause is RevokeCause.HOLDER_REFUSED


def test_a_pin_the_holder_gave_up_for_memory_ends_it_as_memory_pressure_and_renewal_says_so():
    core, _clock, notes, p, _d, ns, retention = setup()
    lease = retention.retain(ns, H, [], 60_000, key="agent-9").lease
    pinned(core, p, lease)
    core.pin_result(p, lease.lease_id, False, [], "waiting request r7 needs 30 GPU blocks", given_up=True)
    assert (lease.state, lease.cause) == (LeaseState.REVOKED, RevokeCause.MEMORY_PRESSURE)
    assert notes.to(p.session_id, "ended") == []  # the holder gave the blocks back itself
    revoked = [e for e in notes.events if e.kind == "lease_revoked" and e.lease.lease_id == lease.lease_id]
    assert revoked and revoked[0].lease.request_id == "retain:agent-9"
    with pytest.raises(FailedPrecondition, match=r"vLLM needed the memory.*r7 needs 30") as exc:
        retention.retain(ns, [], [], 60_000, lease_id=lease.lease_id)
    assert exc.value.cause == Cause.MEMORY_PRESSURE
    # A late give-up of a lease that already ended changes nothing.
    assert (
        core.pin_result(p, lease.lease_id, False, [], "", given_up=True).cause is RevokeCause.MEMORY_PRESSURE
    )


def test_a_newer_retention_replaces_the_older_once_pinned():
    core, _clock, _notes, p, _d, ns, retention = setup()
    old = retention.retain(ns, H[:4], [], 60_000, key="c").lease
    pinned(core, p, old)
    new = retention.retain(ns, H, [], 60_000, key="c", replaces=old.lease_id).lease
    assert old.state is LeaseState.ACTIVE  # kept until the new one is pinned
    pinned(core, p, new)
    assert retention.settled(new, old.lease_id) and old.state is LeaseState.RELEASED
    assert not retention.settled(new, old.lease_id)  # already ended: nothing to replace
    # A previous retention that ended (its TTL, its holder) does not stop the next one.
    third = retention.retain(ns, H, [], 60_000, key="c", replaces=old.lease_id).lease
    assert third.state is LeaseState.PENDING
    hold = core.hold("P", ns, Tier.GPU, H[:2], [1, 2], 10_000)
    with pytest.raises(InvalidArgument, match="not a retention"):
        retention.retain(ns, H, [], 60_000, replaces=hold.lease_id)


def test_with_a_cpu_copy_as_long_it_pins_that_and_leaves_gpu_memory_to_vllm():
    core, _clock, _notes, p, _d, ns, retention = setup()
    core.update_inventory(p, ns, Tier.CPU, H[:10], [])
    assert retention.retain(ns, H, [], 60_000).lease.tier is Tier.CPU
    assert retention.retain(ns, H, [], 60_000, tier_wanted=int(Tier.GPU)).lease.tier is Tier.GPU
    core.update_inventory(p, ns, Tier.CPU, [], H[4:10])  # the CPU copy is shorter: the GPU copy it is
    assert retention.retain(ns, H, [], 60_000).lease.tier is Tier.GPU
    core.update_inventory(p, ns, Tier.CPU, [], H[:4])
    with pytest.raises(NotFound, match="on tier CPU") as exc:
        retention.retain(ns, H, [], 60_000, tier_wanted=int(Tier.CPU))
    assert exc.value.cause == Cause.NOT_CACHED
    with pytest.raises(InvalidArgument, match="tier 7"):
        retention.retain(ns, H, [], 60_000, tier_wanted=7)


def test_it_pins_the_cpu_tier_when_the_engine_keeps_the_prefix_only_there():
    core, _clock, notes, p, _d, ns, retention = setup()
    core.update_inventory(p, ns, Tier.GPU, [], H[:10])
    core.update_inventory(p, ns, Tier.CPU, H[:6], [])
    lease = retention.retain(ns, H, [], 60_000, engine_id="P").lease
    assert (lease.tier, len(lease.block_hashes)) == (Tier.CPU, 6)
    assert notes.to(p.session_id, "pin")[-1].lease is lease


def test_by_token_ids_on_a_named_engine():
    core, _clock, _notes, p, _d, ns, retention = setup()
    from kvbroker.common.hashing import wire_chain

    block_size = core.registry.find_fingerprint(ns.layout_id).block_size
    tokens = list(range(block_size * 3 + 1))  # three full blocks and a partial one
    chain = wire_chain(tokens, block_size, "sha256", None)
    assert len(chain) == 3
    core.update_inventory(p, ns, Tier.GPU, chain, [])
    lease = retention.retain(ns, [], tokens, 60_000, engine_id="P").lease
    assert list(lease.block_hashes) == chain


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"ttl_ms": 0}, InvalidArgument, "ttl_ms is 0"),
        ({"ttl_ms": 10**9}, OutOfRange, "outside the allowed range"),
        ({"engine_id": "nobody"}, NotFound, "unknown engine"),
        ({"hashes": [1, 2, 3]}, NotFound, "retain after the turn finished"),
        ({"engine_id": "D"}, NotFound, "engine 'D' does not hold"),
        ({"hashes": []}, InvalidArgument, "names no full block"),
        ({"tokens": [1, 2]}, InvalidArgument, "give either block_hashes or token_ids"),
        ({"lease_id": "nope"}, NotFound, "unknown lease"),
    ],
)
def test_bad_input_is_refused_precisely(kwargs, error, words):  # type: ignore[no-untyped-def]
    core, _clock, notes, _p, _d, ns, retention = setup()
    args = {"hashes": H, "tokens": [], "ttl_ms": 60_000, **kwargs}
    with pytest.raises(error, match=words) as exc:
        retention.retain(
            ns,
            args.pop("hashes"),
            args.pop("tokens"),
            args.pop("ttl_ms"),
            **args,  # type: ignore[arg-type]
        )
    if kwargs.get("hashes") == [1, 2, 3] or ("engine_id" in kwargs and kwargs["engine_id"] == "D"):
        assert exc.value.cause == Cause.NOT_CACHED
    assert not notes.to("", "pin") and not list(core.leases.live())


def test_a_lease_that_is_not_a_retention_is_not_renewed_or_unretained_here():
    core, _clock, _notes, _p, _d, ns, retention = setup()
    hold = core.hold("P", ns, Tier.GPU, H[:2], [1, 2], 10_000)
    with pytest.raises(InvalidArgument, match="not a retention"):
        retention.unretain(hold.lease_id)
    with pytest.raises(InvalidArgument, match="not a retention"):
        retention.retain(ns, [], [], 1_000, lease_id=hold.lease_id)


def test_quotas_per_tenant_and_per_engine():
    core, _clock, _notes, p, _d, ns, retention = setup(max_retentions_per_tenant=2)
    other = Namespace(ns.layout_id, "tenant-b")
    core.update_inventory(p, other, Tier.GPU, H[:4], [])
    for _ in range(2):
        retention.retain(ns, H, [], 60_000)
    with pytest.raises(QuotaExceeded, match="--max-retentions-per-tenant 2") as exc:
        retention.retain(ns, H, [], 60_000)
    assert exc.value.cause == Cause.QUOTA_EXCEEDED
    retention.retain(other, H, [], 60_000)  # another tenant keeps its own share
    _core2, _c, _n, _p2, _d2, ns2, retention2 = setup(max_leases_per_engine=1)
    retention2.retain(ns2, H, [], 60_000)
    with pytest.raises(ResourceExhausted, match="--max-leases-per-engine"):
        retention2.retain(ns2, H, [], 60_000)


def test_live_retentions_are_a_gauge_by_tier():
    from kvbroker.broker.metrics import BrokerCollector

    core, _clock, _notes, p, _d, ns, retention = setup()
    pinned(core, p, retention.retain(ns, H, [], 60_000).lease)
    core.update_inventory(p, ns, Tier.CPU, H[:10], [])
    retention.retain(ns, H, [], 60_000)  # pending its pin: counted too
    core.hold("P", ns, Tier.GPU, H[:2], [1, 2], 10_000)  # a hold is no retention
    [family] = [m for m in BrokerCollector(core).collect() if m.name == "kvbroker_retentions"]
    assert {s.labels["tier"]: s.value for s in family.samples} == {"gpu": 1, "cpu": 1}
