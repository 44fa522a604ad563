"""Session hijack: another identity cannot take a live engine id; the same identity replaces its own cleanly."""

from __future__ import annotations

import pytest

from kvbroker.clients import errors
from kvbroker.clients.sync import BrokerClient
from kvbroker.clients.threaded_session import ThreadedEngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.processes import BrokerProcess
from testkit.waiting import wait_for
from tests.broker.security.conftest import Pki
from tests.broker.security.world import build_world, stub


def _register(address: str, security, engine_id: str) -> pb.SessionDown:  # type: ignore[no-untyped-def]
    channel, s = stub(address, security)
    try:
        up = pb.SessionUp(seq=1, register=pb.Register(engine=engine_info(engine_id)))
        return next(iter(s.Session(iter([up]), timeout=5)))
    finally:
        channel.close()


def test_another_identity_cannot_take_a_live_engine_id(mtls_broker: BrokerProcess, pki: Pki) -> None:
    world = build_world(mtls_broker.address, pki.mtls)
    try:
        import grpc

        with pytest.raises(grpc.RpcError) as caught:
            _register(mtls_broker.address, pki.mtls("hijacker"), "p0")  # kvbroker://globex/engine/p0
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "globex/engine/p0" in caught.value.details() and "acme/engine/p0" in caught.value.details()
        # An acme engine of another name cannot register p0 either.
        with pytest.raises(grpc.RpcError) as caught:
            _register(mtls_broker.address, pki.mtls("engine"), "p0")
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "rule" in caught.value.details()
        # p0 still has its session and its holds.
        with BrokerClient(mtls_broker.address, security=pki.mtls("operator")) as op:
            lease = next(lease for lease in op.list_leases().leases if lease.lease_id == world.lease_id)
            assert lease.state == pb.LEASE_HELD
        assert world.sessions[0].connected
    finally:
        world.close()


def test_a_restarted_engine_with_the_same_identity_replaces_its_session(
    mtls_broker: BrokerProcess, pki: Pki
) -> None:
    world = build_world(mtls_broker.address, pki.mtls)
    old = world.sessions[0]
    new = ThreadedEngineSession(
        mtls_broker.address, engine_info("p0"), ttl_ms=30_000, security=pki.mtls("p0")
    )
    try:
        new.start(wait_connected_s=15)
        with BrokerClient(mtls_broker.address, security=pki.mtls("operator")) as op:
            ended = {lease.lease_id: lease for lease in op.list_leases(include_ended=True).leases}
            assert wait_for(
                lambda: (
                    op.list_leases(include_ended=True).leases
                    and {
                        lease.lease_id: lease.cause for lease in op.list_leases(include_ended=True).leases
                    }.get(world.lease_id)
                    == pb.REVOKE_HOLDER_GONE
                ),
                10,
            ), ended.get(world.lease_id)
    finally:
        old.close()
        new.close()
        world.close()


def test_plaintext_on_a_network_address_needs_insecure(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = BrokerProcess(tmp_path, ["--address", "0.0.0.0:0"])
    with pytest.raises(RuntimeError, match="--insecure"):
        proc.start(timeout=20)
    with BrokerProcess(tmp_path, ["--address", "0.0.0.0:0", "--insecure"], log_name="insecure.log") as ok:
        assert "PLAINTEXT" in ok.log_tail()


def test_unauthenticated_call_names_what_is_missing(token_broker: BrokerProcess, pki: Pki) -> None:
    with (
        BrokerClient(token_broker.address, security=pki.token(None)) as anonymous,
        pytest.raises(errors.Unauthenticated, match="bearer token"),
    ):
        anonymous.list_engines()
