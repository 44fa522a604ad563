"""`--state redis+cluster://...`: what a Redis Cluster adds beyond the contract suites (which run on a
real 3-primary Cluster too): malformed seed lists are refused with the reason, a resharding's ASK and
TRYAGAIN states are UNAVAILABLE and its MOVED is followed without losing a lease, and a primary that
dies turns the calls it served into UNAVAILABLE (state_unavailable) while the broker keeps running."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from kvbroker.broker.errors import InvalidArgument, Unavailable
from kvbroker.broker.fleet.conn import RedisState, parse_cluster_url
from kvbroker.broker.fleet.leases import RedisLeaseTable
from kvbroker.common.error_details import STATUS_DETAILS_KEY
from kvbroker.common.model import LeaseState, Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.broker import running_broker
from testkit.builders import engine_info
from testkit.ports import free_port
from testkit.redis_cluster import RedisCluster, running_cluster
from testkit.redis_server import missing_reason
from tests.broker.session_util import hold_request, p_holding

H = list(range(9000, 9008))
LEASES_SLOT = 14949  # where every `PREFIX:{leases}:...` key lives


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A Cluster of this test's own: the test reshards it or kills one of its primaries."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    with running_cluster(tmp_path / "cluster") as cluster:
        yield cluster


def test_seed_lists_parse_and_malformed_ones_say_what_is_wrong() -> None:
    nodes, options = parse_cluster_url("rediss+cluster://app:s%40cret@10.0.0.1:7000,[::1]:7001")
    assert nodes == [("10.0.0.1", 7000), ("::1", 7001)]
    assert options == {"ssl": True, "username": "app", "password": "s@cret"}
    for url, words in [
        ("redis+cluster://", "seed node '' is not HOST:PORT"),
        ("redis+cluster://10.0.0.1:7000,10.0.0.2", "seed node '10.0.0.2' is not HOST:PORT"),
        ("redis+cluster://10.0.0.1:70000", "port 1-65535"),
        ("redis+cluster://10.0.0.1:7000/3", "only database 0"),
        ("redis+cluster://10.0.0.1:7000?timeout=1", "no query"),
    ]:
        with pytest.raises(InvalidArgument, match=words):
            parse_cluster_url(url)
    with pytest.raises(InvalidArgument, match=r"redis\+cluster://HOST:PORT\[,HOST:PORT...\]"):
        RedisState("cluster://10.0.0.1:7000")


async def test_a_cluster_that_does_not_answer_is_refused_at_start_without_its_password() -> None:
    url = f"redis+cluster://op:hunter2@127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with pytest.raises(InvalidArgument, match="does not answer") as exc:
        async with running_broker(state=url):
            pass
    assert "hunter2" not in exc.value.message and "op:***@" in exc.value.message


def _node_id(client: redis.Redis) -> str:
    return str(client.execute_command("CLUSTER", "MYID").decode())


def test_resharding_the_lease_slot_is_unavailable_midway_and_followed_after(
    own_cluster: RedisCluster,
) -> None:
    state = RedisState(own_cluster.url, prefix="reshard")
    table = RedisLeaseTable(state)
    lease = table.create(
        holder="P",
        reader="",
        namespace=Namespace("layout", ""),
        tier=Tier.GPU,
        block_hashes=[1, 2],
        block_ids=[3, 4],
        state=LeaseState.HELD,
        ttl_s=60.0,
        deadline=state.now() + 60.0,
        request_id="r1",
    )
    table.claim(lease.lease_id, "D", 60.0, state.now())
    source_node = own_cluster.node_for_slot(LEASES_SLOT)
    target_node = next(n for n in own_cluster.nodes if n is not source_node)
    source, target = source_node.client(), target_node.client()
    clients = [n.client() for n in own_cluster.nodes]
    try:
        target.execute_command("CLUSTER", "SETSLOT", LEASES_SLOT, "IMPORTING", _node_id(source))
        source.execute_command("CLUSTER", "SETSLOT", LEASES_SLOT, "MIGRATING", _node_id(target))
        # Half-way: the lease itself moved, the expiry set not yet. Its script cannot run whole on
        # either node, so the call is UNAVAILABLE (the reader recomputes) and nothing changes.
        lease_key = f"reshard:{{leases}}:l:{lease.lease_id}"
        source.execute_command("MIGRATE", "127.0.0.1", target_node.port, lease_key, 0, 5000)
        with pytest.raises(Unavailable, match="Redis Cluster"):
            table.release(lease.lease_id, "D", 0, state.now())
        # The rest moves and every node learns the new owner: the client follows MOVED.
        while keys := source.execute_command("CLUSTER", "GETKEYSINSLOT", LEASES_SLOT, 100):
            source.execute_command("MIGRATE", "127.0.0.1", target_node.port, "", 0, 5000, "KEYS", *keys)
        for client in clients:
            client.execute_command("CLUSTER", "SETSLOT", LEASES_SLOT, "NODE", _node_id(target))
        released = table.release(lease.lease_id, "D", 0, state.now())
        assert released.state is LeaseState.RELEASED  # the lease lived through it and the read commits
        assert target.exists(lease_key)
        with pytest.raises(redis.exceptions.MovedError):  # the old owner sends clients on
            source.exists(lease_key)
    finally:
        for client in [source, target, *clients]:
            client.close()
        state.close()


async def test_a_primary_down_is_unavailable_and_the_broker_serves_again_once_it_is_back(
    own_cluster: RedisCluster,
) -> None:
    async with (
        running_broker(state=own_cluster.url, session_ttl_min_ms=100, expiry_interval_ms=20) as broker,
        grpc.aio.insecure_channel(broker.address) as channel,
    ):
        stub = broker_pb2_grpc.KVBrokerStub(channel)
        p, ns, held = await p_holding(stub, engine_info("P"), H)

        # kill -9 the primary of the lease slot (no replica to take over): UNAVAILABLE at once.
        node = own_cluster.node_for_slot(LEASES_SLOT)
        node.kill()
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Hold(hold_request(ns, H, "during"))
        assert time.monotonic() - started < 2.0
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        details = dict(exc.value.trailing_metadata() or ()).get(STATUS_DETAILS_KEY)
        assert details is not None and b"state_unavailable" in details
        # Operators' reads of the fleet (lease counts live in the store) say so too, not UNKNOWN.
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Stats(pb.StatsRequest(), timeout=5.0)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE

        # Back on the same port and node id, empty: the lease it lost reads as unknown, new holds work.
        node.start()

        async def hold_again() -> pb.HoldResponse | None:
            try:
                return await stub.Hold(hold_request(ns, H, "after"))
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                return None

        deadline = time.monotonic() + 20.0
        again = None
        while again is None and time.monotonic() < deadline:
            again = await hold_again()
            if again is None:
                await asyncio.sleep(0.2)
        assert again is not None and again.lease.state == pb.LEASE_HELD
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Release(pb.ReleaseRequest(lease_id=held.lease.lease_id, reader_engine_id="D"))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        await p.close()
