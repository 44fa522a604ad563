"""Every RPC as every kind of caller, against real TLS broker processes (mutual TLS, and TLS with tokens).

Callers: no credential, a wrong one (a certificate of another CA, an unknown
token), an engine, a router and an operator of tenant acme, and an identity of
another tenant (globex) of a role the call is for. The requests name acme's
namespace, lease and engines (an engine acts as itself). Each outcome is "ok"
(answered, or refused by the domain: unknown engine, not a party), or the
cause of the refusal (role_denied, other_tenant, ...), or "unavailable" (the
TLS handshake refused the connection).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvbroker.broker.security.auth import ROLES_OF_METHOD
from kvbroker.v1 import broker_pb2 as pb
from tests.broker.security.conftest import Pki
from tests.broker.security.world import World, build_world, outcome, stub

ME = {
    "engine": "e1",
    "router": "r1",
    "operator": "o1",
    "other_engine": "g1",
    "other_router": "g2",
    "other_operator": "g3",
}


def _first(stream: Iterator[Any]) -> Any:
    return next(iter(stream))


def calls(world: World, me: str) -> dict[str, Callable[[Any], object]]:
    ns = world.acme
    hashes = [0x1111, 0x2222]

    def session(s: Any) -> object:
        up = pb.SessionUp(seq=1, register=pb.Register(engine=pb.EngineInfo(engine_id=me, layout=_layout())))
        return _first(s.Session(iter([up]), timeout=5))

    return {
        "Session": session,
        "RegisterRank": lambda s: s.RegisterRank(
            pb.RegisterRankRequest(engine_id=me, rank=pb.RankInfo()), timeout=5
        ),
        "Hold": lambda s: s.Hold(
            pb.HoldRequest(holder_engine_id=me, namespace=ns, block_hashes=hashes, block_ids=[1, 2]),
            timeout=5,
        ),
        "Acquire": lambda s: s.Acquire(
            pb.AcquireRequest(lease_id=world.lease_id, reader_engine_id=me), timeout=5
        ),
        "Renew": lambda s: s.Renew(pb.RenewRequest(lease_id=world.lease_id, engine_id=me), timeout=5),
        "Release": lambda s: s.Release(
            pb.ReleaseRequest(lease_id=world.lease_id, reader_engine_id=me), timeout=5
        ),
        "Decline": lambda s: s.Decline(
            pb.DeclineRequest(holder_engine_id="p0", request_id="nobody"), timeout=5
        ),
        "Resolve": lambda s: s.Resolve(pb.ResolveRequest(namespace=ns, block_hashes=hashes), timeout=5),
        "Mirror": lambda s: _first(s.Mirror(pb.MirrorRequest(layout_id=world.layout_id), timeout=5)),
        "Score": lambda s: s.Score(pb.ScoreRequest(namespace=ns, block_hashes=hashes), timeout=5),
        "ListEngines": lambda s: s.ListEngines(pb.ListEnginesRequest(), timeout=5),
        "ListLeases": lambda s: s.ListLeases(pb.ListLeasesRequest(), timeout=5),
        "Stats": lambda s: s.Stats(pb.StatsRequest(), timeout=5),
        "Revoke": lambda s: s.Revoke(pb.RevokeRequest(lease_id=world.revoke_lease_id), timeout=5),
        "Drain": lambda s: s.Drain(pb.DrainRequest(engine_id="p1"), timeout=5),
        "Watch": lambda s: _first(s.Watch(pb.WatchRequest(), timeout=0.5)),
        "Retain": lambda s: s.Retain(
            pb.RetainRequest(namespace=ns, block_hashes=hashes, ttl_ms=1000), timeout=5
        ),
        "Unretain": lambda s: s.Unretain(pb.UnretainRequest(lease_id=world.lease_id), timeout=5),
    }


def _layout() -> pb.LayoutFingerprint:
    from testkit.builders import fingerprint

    return fingerprint()


def other_caller(method: str) -> str:
    roles = ROLES_OF_METHOD[method]
    for role in ("engine", "router", "operator"):
        if role in roles:
            return "other_" + role
    raise AssertionError(method)


# What each acme caller gets; "allowed" is "ok", everything else names the refusal's cause.
ACME_EXPECTED = {
    # method: (engine, router, operator)
    "Session": ("ok", "role_denied", "role_denied"),
    "RegisterRank": ("ok", "role_denied", "role_denied"),
    "Hold": ("ok", "role_denied", "role_denied"),
    "Acquire": ("ok", "role_denied", "role_denied"),
    "Renew": ("ok", "role_denied", "role_denied"),
    "Release": ("ok", "role_denied", "role_denied"),
    "Decline": ("ok", "ok", "role_denied"),
    "Resolve": ("ok", "ok", "ok"),
    "Mirror": ("ok", "ok", "ok"),
    "Score": ("role_denied", "ok", "ok"),
    "ListEngines": ("role_denied", "ok", "ok"),
    "ListLeases": ("role_denied", "role_denied", "ok"),
    "Stats": ("role_denied", "role_denied", "other_tenant"),  # broker-wide: tenant '*' operators only
    "Revoke": ("role_denied", "role_denied", "ok"),
    "Drain": ("role_denied", "role_denied", "ok"),
    "Watch": ("role_denied", "role_denied", "ok"),
    "Retain": ("role_denied", "ok", "ok"),
    "Unretain": ("role_denied", "ok", "ok"),
}
# Another tenant's identity, of a role the call is for: refused wherever the request names acme's things;
# its own registration and the lists and streams (filtered: see test_isolation) are answered.
OTHER_EXPECTED = {
    "Session": "ok",  # g1 registers itself, in its own tenant
    "RegisterRank": "ok",  # of its own engine id
    "Mirror": "ok",
    "ListEngines": "ok",
    "ListLeases": "ok",
    "Watch": "ok",
}
assert set(ACME_EXPECTED) == set(ROLES_OF_METHOD), "the table covers every RPC"


@pytest.fixture(scope="module", params=["mtls", "token"])
def setup(request: pytest.FixtureRequest, pki: Pki) -> Iterator[tuple[str, World, Pki]]:
    broker = request.getfixturevalue(f"{request.param}_broker")
    security = pki.mtls if request.param == "mtls" else pki.token
    world = build_world(broker.address, security)
    try:
        yield request.param, world, pki
    finally:
        world.close()


CALLERS = ["none", "wrong", "engine", "router", "operator", "other"]


@pytest.mark.timeout(120)
def test_every_rpc_as_every_caller(setup: tuple[str, World, Pki]) -> None:
    transport, world, pki = setup
    security = pki.mtls if transport == "mtls" else pki.token
    got: dict[tuple[str, str], str] = {}
    want: dict[tuple[str, str], str] = {}
    for method in ROLES_OF_METHOD:
        if method == "Revoke":
            continue  # last: it ends a lease the others use
        for caller in CALLERS:
            _check(world, pki, transport, security, method, caller, got, want)
    for caller in CALLERS:
        _check(world, pki, transport, security, "Revoke", caller, got, want)
    wrong = [f"{m} as {c}: got {got[m, c]}, want {want[m, c]}" for (m, c) in want if got[m, c] != want[m, c]]
    assert not wrong, "\n".join(wrong)


def _check(
    world: World,
    pki: Pki,
    transport: str,
    security: Callable[[str | None], Any],
    method: str,
    caller: str,
    got: dict[tuple[str, str], str],
    want: dict[tuple[str, str], str],
) -> None:
    if caller == "none":
        cred, who = security(None), "nobody"
        want[method, caller] = "unavailable" if transport == "mtls" else "unauthenticated"
    elif caller == "wrong":
        cred, who = (pki.mtls("wrong_ca"), "o1") if transport == "mtls" else (pki.token("wrong_token"), "o1")
        want[method, caller] = "unavailable" if transport == "mtls" else "unauthenticated"
    elif caller == "other":
        name = other_caller(method)
        cred, who = security(name), ME[name]
        want[method, caller] = OTHER_EXPECTED.get(method, "other_tenant")
    else:
        cred, who = security(caller), ME[caller]
        want[method, caller] = ACME_EXPECTED[method][("engine", "router", "operator").index(caller)]
    channel, s = stub(world.address, cred)
    try:
        fn = calls(world, who)[method]
        got[method, caller] = outcome(lambda: fn(s))
    finally:
        channel.close()
