"""An engine is its identity, not its name: on every path, on real broker processes.

Tenant acme's engine p0 has a live session on a mutual-TLS broker; tenant
globex's engine identity ``kvbroker://globex/engine/p0`` carries the same
name and calls from the same host. It may not hold as p0 (globex's reader
would then get acme's NIXL agent metadata), resolve-with-acquire as p0, or
act as p0 in any unary lease call; the refusal is always the one cause
``not_yours``. Without identities, a second host may not take a live engine
over by registering its id. Page tokens name only what the caller may see.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvbroker.clients import errors
from kvbroker.clients.sync import BrokerClient
from kvbroker.clients.threaded_session import ThreadedEngineSession
from kvbroker.common.error_details import error_info
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info
from testkit.ports import free_port
from testkit.processes import BrokerProcess
from tests.broker.security.conftest import Pki
from tests.broker.security.world import ACME_HASHES, World, build_world

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def acme_and_globex(mtls_broker: BrokerProcess, pki: Pki) -> Iterator[tuple[World, ThreadedEngineSession]]:
    world = build_world(mtls_broker.address, pki.mtls)
    g1 = ThreadedEngineSession(
        mtls_broker.address, engine_info("g1"), ttl_ms=30_000, security=pki.mtls("other_engine")
    )
    g1.start(wait_connected_s=15)
    try:
        yield world, g1
    finally:
        g1.close()
        world.close()


def _cause(caught: pytest.ExceptionInfo[errors.BrokerError]) -> str:
    return caught.value.cause


def test_another_tenants_engine_of_the_same_name_cannot_act_as_it(
    acme_and_globex: tuple[World, ThreadedEngineSession], pki: Pki
) -> None:
    world, g1 = acme_and_globex
    globex = pb.Namespace(layout_id=world.layout_id, tenant="globex/")
    g1.announce_stored(globex, pb.TIER_GPU, ACME_HASHES)
    g1.applied(10)
    globex_hold = g1.hold(globex, pb.TIER_GPU, ACME_HASHES[:2], [1, 2], 60_000).result(10)
    with BrokerClient(
        world.address, security=pki.mtls("hijacker")
    ) as impostor:  # kvbroker://globex/engine/p0
        # Hold as acme's p0 for globex's reader g1: g1 would then read acme's NIXL metadata.
        with pytest.raises(errors.PermissionDenied, match=r"globex/engine/p0.*acme/engine/p0") as caught:
            impostor.hold(
                holder_engine_id="p0",
                namespace=globex,
                tier=pb.TIER_GPU,
                block_hashes=ACME_HASHES[:2],
                block_ids=[1, 2],
                reader_engine_id="g1",
            )
        assert _cause(caught) == "not_yours"
        # Resolve with acquire as p0: acme's engine would become the reader of a globex lease.
        with pytest.raises(errors.PermissionDenied) as caught:
            impostor.resolve(namespace=globex, block_hashes=ACME_HASHES, acquire=True, engine_id="p0")
        assert _cause(caught) == "not_yours"
        # Every other unary call that acts as an engine, on a lease of the impostor's own tenant:
        # the same check, the same cause (acme's p0 never becomes the reader of globex's lease).
        for call in (
            lambda: impostor.acquire(lease_id=globex_hold.lease_id, reader_engine_id="p0"),
            lambda: impostor.renew(lease_id=globex_hold.lease_id, engine_id="p0"),
            lambda: impostor.release(lease_id=globex_hold.lease_id, reader_engine_id="p0"),
        ):
            with pytest.raises(errors.PermissionDenied) as caught:
                call()
            assert _cause(caught) == "not_yours", caught.value.message
    with BrokerClient(world.address, security=pki.mtls("operator")) as op:
        leases = op.list_leases(include_ended=True).leases
        assert all(lease.namespace.tenant.startswith("acme") for lease in leases)
        assert world.lease_id in {lease.lease_id for lease in leases if lease.state == pb.LEASE_HELD}


def test_an_engine_still_uses_the_unary_lease_calls_as_itself(
    acme_and_globex: tuple[World, ThreadedEngineSession], pki: Pki
) -> None:
    world, _g1 = acme_and_globex
    with BrokerClient(world.address, security=pki.mtls("p0")) as p0:
        held = p0.hold(
            holder_engine_id="p0",
            namespace=world.acme,
            tier=pb.TIER_GPU,
            block_hashes=ACME_HASHES[:1],
            block_ids=[9],
            reader_engine_id="p1",
        )
    with BrokerClient(world.address, security=pki.mtls("p1")) as p1:
        acquired = p1.acquire(lease_id=held.lease.lease_id, reader_engine_id="p1")
        assert acquired.holder.engine_id == "p0" and acquired.holder.ranks[0].agent_metadata
        renewed = p1.renew(lease_id=held.lease.lease_id, engine_id="p1")
        released = p1.release(lease_id=held.lease.lease_id, reader_engine_id="p1", epoch=renewed.lease.epoch)
        assert released.lease.state == pb.LEASE_RELEASED
        # An engine of the same tenant is no more p0 than an engine of another.
        with pytest.raises(errors.PermissionDenied) as caught:
            p1.hold(
                holder_engine_id="p0",
                namespace=world.acme,
                tier=pb.TIER_GPU,
                block_hashes=ACME_HASHES[:1],
                block_ids=[9],
            )
        assert _cause(caught) == "not_yours"


def test_page_tokens_name_only_what_the_caller_may_see(
    acme_and_globex: tuple[World, ThreadedEngineSession], pki: Pki
) -> None:
    world, _g1 = acme_and_globex
    with BrokerClient(world.address, security=pki.mtls("other_operator")) as globex:
        seen: list[str] = []
        token = ""
        while True:
            page = globex.list_engines(page_size=1, page_token=token)
            seen += [e.engine_id for e in page.engines]
            assert not page.next_page_token or page.next_page_token in seen, page.next_page_token
            token = page.next_page_token
            if not token:
                break
        assert seen == ["g1"]
        leases: list[pb.Lease] = []
        token = ""
        while True:
            lease_page = globex.list_leases(page_size=1, page_token=token, include_ended=True)
            leases += lease_page.leases
            token = lease_page.next_page_token
            assert not token or token in {lease.lease_id for lease in leases}, token  # never acme's
            if not token:
                break
        assert all(lease.namespace.tenant.startswith("globex") for lease in leases)


# -- without identities: a second host does not take an engine over ------------------------


@pytest.fixture
def dual_stack_broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    port = free_port()
    with BrokerProcess(tmp_path, ["--address", f"[::]:{port}", "--insecure"], port=port) as proc:
        yield proc


def _register(
    address: str, engine_id: str, done: threading.Event
) -> tuple[grpc.Channel, Iterator[pb.SessionDown]]:
    """A raw Session stream that registers `engine_id` and stays open until `done`."""
    channel = grpc.insecure_channel(address)
    up = pb.SessionUp(seq=1, register=pb.Register(engine=engine_info(engine_id)))

    def ups() -> Iterator[pb.SessionUp]:
        yield up
        done.wait(30)

    return channel, broker_pb2_grpc.KVBrokerStub(channel).Session(ups(), timeout=30)


def test_without_identities_another_host_cannot_take_a_live_engine(dual_stack_broker: BrokerProcess) -> None:
    port = dual_stack_broker.port
    owner = ThreadedEngineSession(f"[::1]:{port}", engine_info("e1"), ttl_ms=30_000)
    owner.start(wait_connected_s=15)
    done = threading.Event()
    channel, downs = _register(f"127.0.0.1:{port}", "e1", done)  # another host, the same engine id
    try:
        with pytest.raises(grpc.RpcError) as caught:
            next(downs)
        err = caught.value
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        info = error_info(err.trailing_metadata())  # type: ignore[attr-defined]
        assert info is not None and info.cause == "session_owned"
        assert "drain" in err.details() and "another engine id" in err.details()  # type: ignore[attr-defined]
        assert owner.connected
        with BrokerClient(f"127.0.0.1:{port}") as client:
            (engine,) = client.list_engines().engines
            assert engine.engine_id == "e1"
        # The same host replaces its own engine (a restart), as before.
        again = ThreadedEngineSession(f"[::1]:{port}", engine_info("e1"), ttl_ms=30_000)
        again.start(wait_connected_s=15)
        again.close()
    finally:
        done.set()
        channel.close()
        owner.close()
