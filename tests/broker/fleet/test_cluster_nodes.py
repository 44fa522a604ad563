"""A Redis Cluster node by node (broker/fleet/nodes.py), on real redis-server Clusters:

- a node that hangs (SIGSTOP: no reset) costs one call's timeout, then every call routed to it is
  UNAVAILABLE at once (our own connections, the client's commands, its pipelines) while the other
  nodes serve on; after SIGCONT its probe closes the breaker and calls to it succeed again;
- a lease's end waits (`WAIT 1`) on the primary that wrote it where that primary has a replica
  online, and is not waited for where it has none (no `WAIT` sent: it would block its timeout);
- a primary that hangs for longer than the Cluster's node timeout is replaced by its replica, and
  the calls for its slots reach the new primary while the old one is still paused (the probe
  refreshes the slot map: no call goes to a suspect node to be redirected);
- connections broken again and again (as through a failover) are dialled again without end: none
  is taken from redis-py's pool, which stops making connections after 100.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest

from kvbroker.broker.errors import Unavailable
from kvbroker.broker.fleet.conn import DURABLE_WAIT_MS, RedisState
from kvbroker.broker.fleet.nodes import online_replicas
from testkit.processes import stopped
from testkit.redis_cluster import RedisCluster, running_cluster
from testkit.redis_server import RedisServer, missing_reason
from testkit.waiting import wait_for

LEASES_SLOT = 14949  # the slot of the `{leases}` tag
FLEET_SLOT = 14574  # the slot of `{fleet}`: another primary's
_SET = "redis.call('SET', KEYS[1], ARGV[1]) return 1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """Three primaries without replicas, of this module's own (a test here pauses one)."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    with running_cluster(tmp_path_factory.mktemp("cluster")) as setup:
        yield setup


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """Three primaries with a replica each (the last test here fails one over)."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    setup = RedisCluster(tmp_path_factory.mktemp("replicated"), with_replicas=True)
    try:
        setup.start(timeout=40.0)
        yield setup
    finally:
        setup.stop()


def _pid(node: RedisServer) -> int:
    assert node.proc is not None
    return node.proc.pid


def _waits(node: RedisServer) -> int:
    """How many WAITs the node has run (INFO commandstats)."""
    client = node.client()  # type: ignore[attr-defined]
    try:
        stats = client.info("commandstats").get("cmdstat_wait")
        return int(stats["calls"]) if stats else 0
    finally:
        client.close()


def _timed_refusals(call: object, n: int) -> float:
    """Seconds that `n` calls took, each of which must be refused with Unavailable."""
    started = time.monotonic()
    for _ in range(n):
        with pytest.raises(Unavailable):
            call()  # type: ignore[operator]
    return time.monotonic() - started


def test_a_hung_node_fails_fast_and_recovers_once_it_answers(cluster: RedisCluster) -> None:
    state = RedisState(cluster.url, prefix=f"t{secrets.token_hex(4)}")
    key, other = "{leases}x", "{fleet}x"
    hung = cluster.node_for_slot(LEASES_SLOT)
    assert hung is not cluster.node_for_slot(FLEET_SLOT)
    try:
        state.command("SET", key, "1")
        with stopped(_pid(hung)):
            with pytest.raises(Unavailable):  # the one call that waits its timeout
                state.command("GET", key)
            # Without the breaker each of these 40 calls would wait 250 ms (10 s in all).
            assert _timed_refusals(lambda: state.command("GET", key), 20) < 2.5
            assert _timed_refusals(lambda: state.call(state.client.get, key), 10) < 2.5

            def piped() -> object:
                pipe = state.client.pipeline(transaction=False)
                pipe.get(key)
                return state.call(pipe.execute)

            assert _timed_refusals(piped, 10) < 2.5
            assert state.command("SET", other, "2") == b"OK"  # the other primaries serve on
            assert state.nodes.suspects() == [f"127.0.0.1:{hung.port}"]

        def answers() -> bool:
            try:
                return state.command("GET", key) == b"1"
            except Unavailable:
                return False

        assert wait_for(answers, 10.0), "the node's breaker did not close after it answered again"
        assert state.call(state.client.get, key) == b"1"
        assert state.nodes.suspects() == []
        assert state.back_for() < 60.0  # it was away, and is back (the session sweep's grace)
    finally:
        state.close()


def test_a_lease_end_waits_for_the_replica_of_the_primary_that_wrote_it(replicated: RedisCluster) -> None:
    state = RedisState(replicated.url, prefix=f"t{secrets.token_hex(4)}")
    primary = replicated.node_for_slot(LEASES_SLOT)
    replica = replicated.replicas[replicated.nodes.index(primary)]  # type: ignore[arg-type]
    script = state.script(_SET)
    # The tests above freeze nodes, which can drop this replica's link for a while; a primary with
    # no replica online is rightly not waited on, so this starts once the primary has one again.
    assert wait_for(lambda: online_replicas(primary.client().info("replication")) >= 1, 30.0)  # type: ignore[attr-defined]
    try:
        before = _waits(primary)
        state.run(script, ["{leases}end"], ["1"])
        assert state.durable() is True
        assert _waits(primary) == before + 1

        # The replica stops acknowledging: the end waits DURABLE_WAIT_MS, then says it is not durable.
        with stopped(_pid(replica)):
            state.run(script, ["{leases}end"], ["2"])
            started = time.monotonic()
            assert state.durable() is False
            assert time.monotonic() - started >= DURABLE_WAIT_MS / 1000 * 0.9
    finally:
        state.close()


def test_a_primary_without_replicas_is_not_waited_on(cluster: RedisCluster) -> None:
    state = RedisState(cluster.url, prefix=f"t{secrets.token_hex(4)}")
    primary = cluster.node_for_slot(LEASES_SLOT)
    try:
        before = _waits(primary)
        for value in range(5):
            state.run(state.script(_SET), ["{leases}end"], [str(value)])
            assert state.durable() is True
        assert _waits(primary) == before  # no WAIT sent: it would have blocked 50 ms each
    finally:
        state.close()


def test_a_hung_primary_replaced_by_its_replica_is_found_while_it_still_hangs(
    replicated: RedisCluster,
) -> None:
    state = RedisState(replicated.url, prefix=f"t{secrets.token_hex(4)}")
    primary = replicated.node_for_slot(LEASES_SLOT)
    replica = replicated.replicas[replicated.nodes.index(primary)]  # type: ignore[arg-type]
    script = state.script(_SET)
    try:
        state.run(script, ["{leases}kept"], ["1"])
        assert state.durable()  # the replica has it
        with stopped(_pid(primary)):
            paused = time.monotonic()
            with pytest.raises(Unavailable):
                state.command("GET", "{leases}kept")

            def served() -> bool:
                try:
                    return state.command("GET", "{leases}kept") == b"1"
                except Unavailable:
                    return False

            assert wait_for(served, 30.0), "the promoted replica was not found while the old primary hung"
            print(f"\nhung primary replaced: served again {time.monotonic() - paused:.2f} s after SIGSTOP")
            client = replica.client()  # type: ignore[attr-defined]
            try:
                assert client.info("replication").get("role") == "master"
            finally:
                client.close()
            state.run(script, ["{leases}kept"], ["2"])
            assert state.durable() is True  # the new primary has no replica online: not waited on
    finally:
        state.close()


def test_connections_broken_again_and_again_are_dialled_again_without_running_out(
    cluster: RedisCluster,
) -> None:
    """Each broken connection to a node is replaced; redis-py's pool counts the connections it made
    (at most 100), so a replacement taken from it ran out during a failover's stream of errors."""
    state = RedisState(cluster.url, prefix=f"t{secrets.token_hex(4)}")
    node = cluster.node_for_slot(LEASES_SLOT)
    admin = node.client()  # type: ignore[attr-defined]
    script = state.script(_SET)
    try:
        for value in range(240):  # about one new connection per two kills
            state.run(script, ["{leases}again"], [str(value)])
            admin.client_kill_filter(_type="normal", skipme=True)  # every connection but the admin's
        state.run(script, ["{leases}again"], ["last"])
        assert state.command("GET", "{leases}again") == b"last"
    finally:
        admin.close()
        state.close()
