"""Random credentials and namespaces against a real TLS broker with tokens: no call crosses a tenant.

Whatever token (known or made up) and namespace tenant hypothesis picks, the
broker answers with a precise status: UNAUTHENTICATED for an unknown token,
PERMISSION_DENIED for a tenant that is not the caller's, never UNKNOWN or
INTERNAL; a call that succeeds named the caller's own tenant; and the broker
keeps serving.
"""

from __future__ import annotations

import string
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker.broker.security.identity import parse_identity
from kvbroker.clients.credentials import ClientSecurity
from kvbroker.v1 import broker_pb2 as pb
from testkit.processes import BrokerProcess
from tests.broker.security.conftest import IDENTITIES, Pki
from tests.broker.security.world import World, build_world, stub

WORD = st.text(alphabet=string.ascii_letters + string.digits + "-_.", min_size=1, max_size=24)
TENANTS = st.one_of(
    st.sampled_from(
        ["", "acme", "acme/", "acme/x", "globex", "globex/", "globex/y", "*", "/", "acmex/", "acme//"]
    ),
    st.builds(lambda a, b: f"{a}/{b}", WORD, WORD),
    st.text(max_size=40),
)
CALLERS = st.one_of(st.sampled_from(sorted(IDENTITIES)), WORD.map(lambda w: "made-up:" + w))


@pytest.fixture(scope="module")
def world(token_broker: BrokerProcess, pki: Pki) -> Iterator[World]:
    w = build_world(token_broker.address, pki.token)
    try:
        yield w
    finally:
        w.close()


def _security(pki: Pki, caller: str, tmp: Path) -> ClientSecurity:
    if caller.startswith("made-up:"):
        path = tmp / "made-up.token"
        path.write_text(caller.removeprefix("made-up:"))
        return ClientSecurity(tls_ca=str(pki.ca.cert), token_file=str(path))
    return pki.token(caller)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(caller=CALLERS, tenant=TENANTS, method=st.sampled_from(["Resolve", "Score", "Hold", "ListEngines"]))
def test_random_credentials_and_namespaces(
    world: World, pki: Pki, tmp_path: Path, caller: str, tenant: str, method: str
) -> None:
    ns = pb.Namespace(layout_id=world.layout_id, tenant=tenant)
    channel, s = stub(world.address, _security(pki, caller, tmp_path))
    who = None if caller.startswith("made-up:") else parse_identity(IDENTITIES[caller])
    try:
        if method == "Resolve":
            s.Resolve(pb.ResolveRequest(namespace=ns, block_hashes=[1, 2]), timeout=5)
        elif method == "Score":
            s.Score(pb.ScoreRequest(namespace=ns, block_hashes=[1, 2]), timeout=5)
        elif method == "Hold":
            name = who.name if who is not None else "p0"
            s.Hold(
                pb.HoldRequest(
                    holder_engine_id=name, namespace=ns, block_hashes=[1], block_ids=[1], ttl_ms=1000
                ),
                timeout=5,
            )
        else:
            s.ListEngines(pb.ListEnginesRequest(), timeout=5)
    except grpc.RpcError as err:
        code = err.code()  # type: ignore[attr-defined]
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), err
        if who is None:
            assert code == grpc.StatusCode.UNAUTHENTICATED, err
        elif method != "ListEngines" and not who.owns_tenant(tenant):
            assert code == grpc.StatusCode.PERMISSION_DENIED, err
        return
    finally:
        channel.close()
    assert who is not None, "an unknown token was answered"
    if method != "ListEngines":
        assert who.owns_tenant(tenant), f"{who} succeeded in tenant {tenant!r}"


def test_the_broker_still_serves_after_the_property(world: World, pki: Pki) -> None:
    channel, s = stub(world.address, pki.token("root"))
    try:
        assert s.Stats(pb.StatsRequest(), timeout=5).engines >= 2
    finally:
        channel.close()
