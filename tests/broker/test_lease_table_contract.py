"""The LeaseTable contract: every backend must pass these (in-memory, Redis, and a Redis Cluster)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvbroker.broker.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvbroker.broker.fleet.leases import RedisLeaseTable
from kvbroker.broker.leases import InMemoryLeaseTable, Lease, LeaseTable
from kvbroker.common.model import LeaseState, Namespace, RevokeCause, Tier
from tests.broker.helpers import redis_state

BACKENDS: dict[str, Callable[[pytest.FixtureRequest], LeaseTable]] = {
    "in-memory": lambda _: InMemoryLeaseTable(history=4),
    # A real redis-server started by the tests (skipped, with the reason, where none can run).
    "redis": lambda request: RedisLeaseTable(redis_state(request.getfixturevalue("redis_server")), history=4),
    # A real 3-primary Redis Cluster started by the tests: the lease keys on one slot.
    "redis-cluster": lambda request: RedisLeaseTable(
        redis_state(request.getfixturevalue("redis_cluster")), history=4
    ),
}
NS = Namespace("layout", "")


@pytest.fixture(params=list(BACKENDS))
def table(request: pytest.FixtureRequest) -> LeaseTable:
    return BACKENDS[request.param](request)


def hold(
    table: LeaseTable, reader: str = "", ttl: float = 10.0, now: float = 0.0, holder: str = "P", most: int = 0
) -> Lease:
    return table.create(
        holder=holder,
        reader=reader,
        namespace=NS,
        tier=Tier.GPU,
        block_hashes=[1, 2],
        block_ids=[10, 11],
        state=LeaseState.HELD,
        ttl_s=ttl,
        deadline=now + ttl,
        request_id="r1",
        max_leases=most,
    )


def test_claim_release_and_lookups(table: LeaseTable) -> None:
    lease = hold(table)
    assert table.by_holder("P") == [lease] and table.by_reader("D") == []
    table.claim(lease.lease_id, "D", 5.0, now=1.0)
    assert lease.state is LeaseState.ACTIVE and lease.deadline == 6.0
    assert table.by_reader("D") == [lease]
    epoch = lease.epoch
    table.release(lease.lease_id, "D", epoch, now=2.0)
    assert lease.state is LeaseState.RELEASED
    assert table.by_holder("P") == [] and table.by_reader("D") == []
    assert table.get(lease.lease_id) is lease  # still answerable after it ended
    assert list(table.recently_ended()) == [lease]


def test_ids_are_unique(table: LeaseTable) -> None:
    ids = {hold(table).lease_id for _ in range(50)}
    assert len(ids) == 50


def test_claim_rules(table: LeaseTable) -> None:
    named = hold(table, reader="D")
    with pytest.raises(PermissionDenied):
        table.claim(named.lease_id, "X", 1.0, 0.0)
    table.claim(named.lease_id, "D", 1.0, 0.0)
    with pytest.raises(FailedPrecondition, match="only a held lease"):
        table.claim(named.lease_id, "D", 1.0, 0.0)
    with pytest.raises(NotFound):
        table.claim("missing", "D", 1.0, 0.0)


def test_live_lease_limits_are_checked_with_the_change(table: LeaseTable) -> None:
    first = hold(table, most=2)
    hold(table, reader="D", most=2)
    with pytest.raises(ResourceExhausted, match="engine 'P' holds 2 live leases") as held:
        hold(table, most=2)
    assert held.value.metadata == {"engine_id": "P", "limit": "2"}
    assert table.count_by_holder("P") == 2  # the refused one left nothing behind
    hold(table, reader="D", holder="Q", most=2)  # D reads 2 now
    with pytest.raises(ResourceExhausted, match="engine 'D' reads 2 live leases"):
        hold(table, reader="D", holder="R", most=2)
    with pytest.raises(ResourceExhausted, match="engine 'D' reads 2 live leases"):
        table.claim(first.lease_id, "D", 1.0, 0.0, max_leases=2)
    assert table.get(first.lease_id).state is LeaseState.HELD and table.count_by_holder("R") == 0
    named = table.by_reader("D")[0]
    table.claim(named.lease_id, "D", 1.0, 0.0, max_leases=2)  # already counted: no new read
    table.claim(first.lease_id, "E", 1.0, 0.0, max_leases=2)
    assert table.get(first.lease_id).reader == "E"


def test_claim_vets_a_reader_the_hold_did_not_name(table: LeaseTable) -> None:
    lease = hold(table)
    seen: list[tuple[str, str, LeaseState]] = []

    def refuse(found: Lease) -> None:
        seen.append((found.lease_id, found.holder, found.state))
        raise InvalidArgument("not this pair")

    with pytest.raises(InvalidArgument, match="not this pair"):
        table.claim(lease.lease_id, "D", 1.0, 0.0, vet=refuse)
    assert seen == [(lease.lease_id, "P", LeaseState.HELD)]
    assert table.get(lease.lease_id).state is LeaseState.HELD and table.by_reader("D") == []
    table.claim(
        lease.lease_id, "D", 1.0, 0.0, vet=lambda found: seen.append(("ok", found.holder, found.state))
    )
    assert seen[-1] == ("ok", "P", LeaseState.HELD) and lease.state is LeaseState.ACTIVE
    named = hold(table, reader="D")  # vetted when it was held: a table may skip the vet
    table.claim(
        named.lease_id, "D", 1.0, 0.0, vet=lambda found: seen.append(("named", found.holder, found.state))
    )
    assert named.state is LeaseState.ACTIVE
    with pytest.raises(NotFound):
        table.claim("missing", "D", 1.0, 0.0, vet=refuse)


def test_renew_only_extends_and_bumps_epoch(table: LeaseTable) -> None:
    lease = hold(table, ttl=10.0)
    e = lease.epoch
    table.renew(lease.lease_id, "P", 1.0, now=0.0)
    assert lease.deadline == 10.0 and lease.epoch == e + 1
    table.renew(lease.lease_id, "P", 20.0, now=5.0)
    assert lease.deadline == 25.0
    with pytest.raises(PermissionDenied):
        table.renew(lease.lease_id, "X", 1.0, 0.0)


def test_revoke_expired_skips_renewed_and_reports_cause(table: LeaseTable) -> None:
    a = hold(table, ttl=1.0)
    b = hold(table, ttl=1.0)
    table.renew(b.lease_id, "P", 5.0, now=0.5)
    ended = table.revoke_expired(now=2.0, limit=100)
    assert ended == [a] and a.cause is RevokeCause.TTL_EXPIRED
    assert b.state is LeaseState.HELD
    assert table.revoke_expired(now=4.0, limit=100) == []
    assert table.revoke_expired(now=5.6, limit=100) == [b]


def test_revoke_expired_is_rate_limited(table: LeaseTable) -> None:
    leases = [hold(table, ttl=1.0) for _ in range(5)]
    assert len(table.revoke_expired(now=2.0, limit=2)) == 2
    assert len(table.revoke_expired(now=2.0, limit=10)) == 3
    assert all(lease.state is LeaseState.REVOKED for lease in leases)


def test_pending_timeout_is_a_refusal(table: LeaseTable) -> None:
    lease = table.create(
        holder="P",
        reader="D",
        namespace=NS,
        tier=Tier.CPU,
        block_hashes=[1],
        block_ids=[],
        state=LeaseState.PENDING,
        ttl_s=30.0,
        deadline=0.5,
        request_id="",
    )
    assert table.expire_if_due(lease.lease_id, now=0.4) is None
    assert table.expire_if_due(lease.lease_id, now=0.6) is lease
    assert lease.cause is RevokeCause.HOLDER_REFUSED


def test_activate_pending(table: LeaseTable) -> None:
    lease = table.create(
        holder="P",
        reader="D",
        namespace=NS,
        tier=Tier.CPU,
        block_hashes=[1, 2],
        block_ids=[],
        state=LeaseState.PENDING,
        ttl_s=30.0,
        deadline=0.5,
        request_id="",
    )
    with pytest.raises(PermissionDenied):
        table.activate(lease.lease_id, "X", [1, 2], now=0.1)
    table.activate(lease.lease_id, "P", [7, 8], now=0.1)
    assert (
        lease.state is LeaseState.ACTIVE
        and list(lease.block_ids) == [7, 8]
        and lease.deadline == pytest.approx(30.1)
    )


def test_release_after_revoke_names_the_cause(table: LeaseTable) -> None:
    lease = hold(table, reader="D")
    table.claim(lease.lease_id, "D", 1.0, 0.0)
    table.revoke(lease.lease_id, RevokeCause.OPERATOR, "ops")
    with pytest.raises(FailedPrecondition, match=r"revoked \(operator\): ops") as exc:
        table.release(lease.lease_id, "D", 0, 0.0)
    assert exc.value.cause == "operator"
    assert table.revoke(lease.lease_id, RevokeCause.OPERATOR, "again") is None


def test_history_is_bounded(table: LeaseTable) -> None:
    leases = [hold(table) for _ in range(6)]
    for lease in leases:
        table.revoke(lease.lease_id, RevokeCause.OPERATOR, "")
    assert len(list(table.recently_ended())) == 4
    with pytest.raises(NotFound):
        table.get(leases[0].lease_id)
    assert table.live_counts()[LeaseState.HELD] == 0
