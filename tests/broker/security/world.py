"""A tenant's fleet on a real TLS broker: engines p0 and p1 of tenant acme with live sessions, blocks, holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from kvbroker.clients.credentials import ClientSecurity, sync_channel
from kvbroker.clients.sync import BrokerClient
from kvbroker.clients.threaded_session import ThreadedEngineSession
from kvbroker.common.error_details import error_info
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.builders import engine_info
from testkit.waiting import wait_for

ACME_HASHES = [0x1111, 0x2222, 0x3333, 0x4444]
# The causes that say "you may not": who you are (or are not) decided it, not the domain.
AUTH_CAUSES = ("unauthenticated", "role_denied", "other_tenant", "not_yours", "session_owned")


@dataclass
class World:
    address: str
    layout_id: str
    lease_id: str  # a hold of p0, in acme
    revoke_lease_id: str  # another one, for Revoke
    sessions: list[ThreadedEngineSession] = field(default_factory=list)

    def close(self) -> None:
        for s in self.sessions:
            s.close()

    @property
    def acme(self) -> pb.Namespace:
        return pb.Namespace(layout_id=self.layout_id, tenant="acme/")


def build_world(address: str, security: Callable[[str], ClientSecurity]) -> World:
    sessions = []
    for name in ("p0", "p1"):
        s = ThreadedEngineSession(address, engine_info(name), ttl_ms=30_000, security=security(name))
        s.start(wait_connected_s=15)
        sessions.append(s)
    p0 = sessions[0]
    ns = pb.Namespace(layout_id=p0.layout_id, tenant="acme/")
    p0.announce_stored(ns, pb.TIER_GPU, ACME_HASHES)
    p0.applied(10)
    with BrokerClient(address, security=security("p0")) as client:
        leases = [
            client.hold(
                holder_engine_id="p0",
                namespace=ns,
                tier=pb.TIER_GPU,
                block_hashes=ACME_HASHES[:2],
                block_ids=[1, 2],
                ttl_ms=600_000,
                request_id=f"req-{i}",
            ).lease.lease_id
            for i in range(2)
        ]
    return World(address, p0.layout_id, leases[0], leases[1], sessions)


def stub(address: str, security: ClientSecurity) -> tuple[grpc.Channel, broker_pb2_grpc.KVBrokerStub]:
    channel = sync_channel(address, security, [])
    return channel, broker_pb2_grpc.KVBrokerStub(channel)


def outcome(call: Callable[[], object]) -> str:
    """ "ok" (answered, or refused by the domain), "unavailable", or the auth cause that refused it."""
    try:
        call()
    except grpc.RpcError as err:
        code = err.code()  # type: ignore[attr-defined]
        if code == grpc.StatusCode.UNAVAILABLE:
            return "unavailable"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "ok"  # a stream that had nothing to say yet
        info = error_info(err.trailing_metadata())  # type: ignore[attr-defined]
        cause = info.cause if info is not None else ""
        if (
            code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
            and cause in AUTH_CAUSES
        ):
            assert err.details(), "a refusal names the identity and the rule"  # type: ignore[attr-defined]
            return cause
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            assert cause == "not_party", f"{code.name} with cause {cause!r}: {err.details()}"  # type: ignore[attr-defined]
        return "ok"
    return "ok"


def wait_engines(address: str, security: ClientSecurity, count: int) -> bool:
    with BrokerClient(address, security=security) as client:
        return wait_for(lambda: len(client.list_engines().engines) >= count, 10)
