"""Quotas per tenant and per identity: one tenant using up its share leaves another's calls answered.

A real mutual-TLS broker process with small quotas. Each refusal is
RESOURCE_EXHAUSTED (cause quota_exceeded) and names the limit's flag.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvbroker.clients import errors
from kvbroker.clients.sync import BrokerClient
from kvbroker.clients.threaded_session import ThreadedEngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.processes import BrokerProcess
from tests.broker.security.conftest import Pki, tls_args
from tests.broker.security.world import ACME_HASHES, World, build_world, stub

QUOTAS = ["--quota-rate", "20", "--quota-burst", "20", "--quota-leases", "3", "--quota-sessions", "2"]
QUOTAS += ["--quota-streams", "1"]


@pytest.fixture(scope="module")
def quota_world(
    pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[World, ThreadedEngineSession]]:
    args = tls_args(pki, mutual=True, tokens=False) + QUOTAS
    with BrokerProcess(tmp_path_factory.mktemp("quotas"), args) as proc:
        world = build_world(proc.address, pki.mtls)  # acme: p0 and p1, two holds of p0
        g1 = ThreadedEngineSession(
            proc.address, engine_info("g1"), ttl_ms=30_000, security=pki.mtls("other_engine")
        )
        g1.start(wait_connected_s=15)
        try:
            yield world, g1
        finally:
            g1.close()
            world.close()


def test_one_identity_over_its_rate_does_not_slow_another_tenant(
    quota_world: tuple[World, ThreadedEngineSession], pki: Pki
) -> None:
    world, _g1 = quota_world
    globex_ns = pb.Namespace(layout_id=world.layout_id, tenant="globex/")
    refused: list[str] = []
    stop = threading.Event()

    def hammer() -> None:
        with BrokerClient(world.address, security=pki.mtls("router")) as acme:
            while not stop.is_set():
                try:
                    acme.score(namespace=world.acme, block_hashes=ACME_HASHES)
                except errors.ResourceExhausted as err:
                    refused.append(err.message)

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    latencies = []
    try:
        with BrokerClient(world.address, security=pki.mtls("other_router")) as globex:
            globex.wait_ready(5)
            for _ in range(10):
                start = time.perf_counter()
                globex.score(namespace=globex_ns, block_hashes=ACME_HASHES)  # never refused
                latencies.append(time.perf_counter() - start)
                time.sleep(0.1)
    finally:
        stop.set()
        thread.join(10)
    assert refused, "the hammering identity was never refused"
    assert "--quota-rate 20" in refused[0] and "acme/router/r1" in refused[0]
    assert len(latencies) == 10 and statistics.median(latencies) < 0.5, latencies


def test_lease_quota_is_per_tenant(quota_world: tuple[World, ThreadedEngineSession], pki: Pki) -> None:
    world, g1 = quota_world
    with BrokerClient(world.address, security=pki.mtls("p0")) as p0:
        hold = {
            "holder_engine_id": "p0",
            "namespace": world.acme,
            "tier": pb.TIER_GPU,
            "block_hashes": ACME_HASHES[:1],
            "block_ids": [7],
            "ttl_ms": 60_000,
        }
        p0.hold(request_id="third", **hold)  # the world holds two already: three is the quota
        with pytest.raises(errors.ResourceExhausted, match="--quota-leases 3"):
            p0.hold(request_id="fourth", **hold)
    lease = g1.hold(
        pb.Namespace(layout_id=world.layout_id, tenant="globex/"), pb.TIER_GPU, ACME_HASHES[:1], [3], 60_000
    ).result(10)
    assert lease.state == pb.LEASE_HELD


def test_session_and_stream_quotas_are_per_tenant_and_identity(
    quota_world: tuple[World, ThreadedEngineSession], pki: Pki
) -> None:
    world, _g1 = quota_world
    channel, s = stub(world.address, pki.mtls("engine"))  # acme's third engine: over --quota-sessions 2
    try:
        up = pb.SessionUp(seq=1, register=pb.Register(engine=engine_info("e1")))
        with pytest.raises(grpc.RpcError) as caught:
            next(iter(s.Session(iter([up]), timeout=5)))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--quota-sessions 2" in caught.value.details()
    finally:
        channel.close()
    first_channel, first = stub(world.address, pki.mtls("operator"))
    watch = first.Watch(pb.WatchRequest(), timeout=10)
    try:
        time.sleep(0.5)  # the first is open and counted
        assert watch.running(), watch
        second_channel, second = stub(world.address, pki.mtls("operator"))
        try:
            with pytest.raises(grpc.RpcError) as caught:
                next(iter(second.Watch(pb.WatchRequest(), timeout=5)))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--quota-streams 1" in caught.value.details()
        finally:
            second_channel.close()
        other_channel, other = stub(world.address, pki.mtls("other_operator"))
        try:
            with pytest.raises(grpc.RpcError) as caught:
                next(iter(other.Watch(pb.WatchRequest(), timeout=0.5)))
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # open, and quiet
        finally:
            other_channel.close()
    finally:
        watch.cancel()
        first_channel.close()


def test_indexed_blocks_quota_is_per_tenant(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> None:
    args = [*tls_args(pki, mutual=True, tokens=False), "--quota-blocks", "10"]
    with BrokerProcess(tmp_path_factory.mktemp("blocks"), args) as proc:
        sessions = []
        try:
            for who, name in (("p0", "p0"), ("other_engine", "g1")):
                s = ThreadedEngineSession(
                    proc.address, engine_info(name), ttl_ms=30_000, security=pki.mtls(who)
                )
                s.start(wait_connected_s=15)
                sessions.append(s)
            p0, g1 = sessions
            acme = pb.Namespace(layout_id=p0.layout_id, tenant="acme/")
            globex = pb.Namespace(layout_id=p0.layout_id, tenant="globex/")
            p0.announce_stored(acme, pb.TIER_GPU, range(1, 9))
            p0.applied(10)
            p0.announce_stored(acme, pb.TIER_GPU, range(100, 108))  # 16 > 10: refused as a whole
            p0.applied(10)
            g1.announce_stored(globex, pb.TIER_GPU, range(1, 9))  # globex has its own 10
            g1.applied(10)
            with BrokerClient(proc.address, security=pki.mtls("root")) as root:
                assert root.stats().blocks_indexed == 16
                counts = {e.engine_id: e.blocks_gpu for e in root.list_engines().engines}
            assert counts == {"p0": 8, "g1": 8}
        finally:
            for s in sessions:
                s.close()
