"""Tenants never see each other: resolve, score, mirror, watch and the lists leak nothing across them.

Tenant acme's engine p0 and tenant globex's engine g1 announce the same block
hashes, each in its own tenant, on a real mutual-TLS broker process. Whatever
globex asks, it sees only g1; acme sees only its own engines.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from kvbroker.clients import errors
from kvbroker.clients.sync import BrokerClient
from kvbroker.clients.threaded_session import ThreadedEngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for
from tests.broker.security.conftest import Pki
from tests.broker.security.world import ACME_HASHES, World, build_world


@pytest.fixture(scope="module")
def two_tenants(mtls_broker: BrokerProcess, pki: Pki) -> Iterator[tuple[World, ThreadedEngineSession]]:
    world = build_world(mtls_broker.address, pki.mtls)
    g1 = ThreadedEngineSession(
        mtls_broker.address, engine_info("g1"), ttl_ms=30_000, security=pki.mtls("other_engine")
    )
    g1.start(wait_connected_s=15)
    g1.announce_stored(pb.Namespace(layout_id=world.layout_id, tenant="globex/"), pb.TIER_GPU, ACME_HASHES)
    g1.applied(10)
    try:
        yield world, g1
    finally:
        g1.close()
        world.close()


def test_resolve_and_score_see_only_the_callers_tenant(
    two_tenants: tuple[World, ThreadedEngineSession], pki: Pki
) -> None:
    world, _g1 = two_tenants
    globex = pb.Namespace(layout_id=world.layout_id, tenant="globex/")
    with BrokerClient(world.address, security=pki.mtls("other_router")) as router:
        found = router.resolve(namespace=globex, block_hashes=ACME_HASHES)
        assert [m.engine_id for m in found.matches] == ["g1"]
        scores = router.score(namespace=globex, block_hashes=ACME_HASHES)
        assert {s.engine_id for s in scores.scores} == {"g1"}
        for call in (router.resolve, router.score):
            with pytest.raises(errors.PermissionDenied, match=r"globex/router/g2.*rule"):
                call(namespace=world.acme, block_hashes=ACME_HASHES)
        # A salt is a namespace inside the tenant: nothing of globex/ shows under globex/other.
        salted = pb.Namespace(layout_id=world.layout_id, tenant="globex/other")
        assert not router.resolve(namespace=salted, block_hashes=ACME_HASHES).matches
    with BrokerClient(world.address, security=pki.mtls("router")) as router:
        found = router.resolve(namespace=world.acme, block_hashes=ACME_HASHES)
        assert [m.engine_id for m in found.matches] == ["p0"]


def test_lists_show_only_the_callers_tenant_and_routers_get_no_nixl_metadata(
    two_tenants: tuple[World, ThreadedEngineSession], pki: Pki
) -> None:
    world, _g1 = two_tenants
    with BrokerClient(world.address, security=pki.mtls("other_router")) as router:
        engines = router.list_engines().engines
        assert [e.engine_id for e in engines] == ["g1"]
        assert all(not r.agent_metadata for e in engines for r in e.ranks)
    with BrokerClient(world.address, security=pki.mtls("other_operator")) as operator:
        assert [e.engine_id for e in operator.list_engines().engines] == ["g1"]
        assert not operator.list_leases(include_ended=True).leases  # acme's holds stay acme's
    with BrokerClient(world.address, security=pki.mtls("operator")) as operator:
        engines = operator.list_engines().engines
        assert {e.engine_id for e in engines} >= {"p0", "p1"} and "g1" not in {e.engine_id for e in engines}
        assert all(r.agent_metadata for e in engines for r in e.ranks)
        leases = operator.list_leases().leases
        assert leases and all(lease.namespace.tenant.startswith("acme") for lease in leases)
    with BrokerClient(world.address, security=pki.mtls("root")) as root:
        assert {"p0", "g1"} <= {e.engine_id for e in root.list_engines().engines}
        assert root.stats().engines >= 3


def test_mirror_of_another_tenant_carries_nothing_of_acme(
    two_tenants: tuple[World, ThreadedEngineSession], pki: Pki
) -> None:
    world, _g1 = two_tenants
    channel, stub = _stub(world.address, pki, "other_router")
    seen_engines: set[str] = set()
    seen_tenants: set[str] = set()
    try:
        for update in stub.Mirror(pb.MirrorRequest(layout_id=world.layout_id), timeout=10):
            seen_engines |= {e.engine.engine_id for e in update.engines}
            seen_engines |= {b.engine_id for b in update.blocks}
            seen_tenants |= {b.tenant for b in update.blocks if b.stored}
            if update.synced:
                break
    finally:
        channel.close()
    assert seen_engines == {"g1"}
    assert seen_tenants == {"globex/"}


def test_watch_of_another_tenant_sees_none_of_acmes_events(
    two_tenants: tuple[World, ThreadedEngineSession], pki: Pki
) -> None:
    world, g1 = two_tenants
    p0 = world.sessions[0]
    channel, stub = _stub(world.address, pki, "other_operator")
    events: list[pb.WatchEvent] = []
    stream = stub.Watch(pb.WatchRequest(), timeout=20)

    def read() -> None:
        try:
            for event in stream:
                events.append(event)
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(lambda: False, 0.3)  # the stream is open before the events
        p0.announce_stored(world.acme, pb.TIER_GPU, [0xA1, 0xA2])
        p0.applied(10)
        g1.announce_stored(pb.Namespace(layout_id=world.layout_id, tenant="globex/"), pb.TIER_GPU, [0xB1])
        g1.applied(10)
        assert wait_for(lambda: any(e.engine_id == "g1" for e in events), 10), events
    finally:
        stream.cancel()
        channel.close()
        reader.join(5)
    assert events and all(e.engine_id == "g1" for e in events), [(e.kind, e.engine_id) for e in events]


def _stub(address: str, pki: Pki, who: str):  # type: ignore[no-untyped-def]
    from tests.broker.security.world import stub

    return stub(address, pki.mtls(who))
