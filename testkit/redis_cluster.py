"""A real 3-primary Redis Cluster (Debian's redis-server, three processes) on free loopback ports.

Each node gets a free client port and a free cluster-bus port; the 16,384
slots are split in three ranges (CLUSTER ADDSLOTSRANGE), the nodes meet
(CLUSTER MEET), and `start` returns once every node reports cluster_state:ok.
No replicas, nothing persisted. `url` is the broker's `--state` for it:
`redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from testkit.ports import free_port
from testkit.redis_server import RedisServer

SLOTS = 16384
# Where each primary's slot range starts. Not an even split: the fleet's `{fleet}` keys (slot 14574)
# and `{leases}` keys (slot 14949) land on different primaries, so a script that strayed from its
# own slot would meet a key on another node and fail, instead of passing by luck.
STARTS = (0, 5461, 14700)


class ClusterNode(RedisServer):
    """One cluster-enabled redis-server: RedisServer with a cluster-bus port."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.bus_port = free_port()

    def renew_ports(self) -> None:
        super().renew_ports()
        self.bus_port = free_port()
        (self.workdir / "nodes.conf").unlink(missing_ok=True)  # written before the bind failed

    def extra_args(self) -> list[str]:
        return [
            "--cluster-port", str(self.bus_port),
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "2000",
        ]  # fmt: skip

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=2.0)

    def kill(self) -> None:
        """kill -9: the node is gone without a word to its peers."""
        self.stop()


class RedisCluster:
    def __init__(self, workdir: Path, starts: tuple[int, ...] = STARTS, with_replicas: bool = False) -> None:
        """`with_replicas`: one replica per primary (`CLUSTER REPLICATE`), so a primary that dies
        fails over to it after the node timeout (2 s) instead of leaving its slots down."""
        self.starts = starts
        self.nodes = [ClusterNode(workdir / f"node{i}") for i in range(len(starts))]
        self.replicas = (
            [ClusterNode(workdir / f"replica{i}") for i in range(len(starts))] if with_replicas else []
        )

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node.start(timeout)  # returns once the node answers PING
        clients = [node.client() for node in self.nodes]
        try:
            ends = [*self.starts[1:], SLOTS]
            for first, end, client in zip(self.starts, ends, clients, strict=True):
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, end - 1)
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
            for client in clients:
                while client.cluster("INFO").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the Redis Cluster did not reach cluster_state:ok in {timeout} s")
                    time.sleep(0.05)
            # Every node must know every slot's owner before a client asks it.
            for client in clients:
                while len(client.execute_command("CLUSTER", "SLOTS")) < len(self.nodes):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the Redis Cluster's nodes did not learn each other's slots")
                    time.sleep(0.05)
            self._add_replicas(clients[0], deadline)
        finally:
            for client in clients:
                client.close()

    def _add_replicas(self, seed: Any, deadline: float) -> None:
        if not self.replicas:
            return
        for replica in self.replicas:
            replica.start()
            seed.execute_command("CLUSTER", "MEET", "127.0.0.1", replica.port, replica.bus_port)
        for primary, replica in zip(self.nodes, self.replicas, strict=True):
            primary_id = primary.client().execute_command("CLUSTER", "MYID")
            client = replica.client()
            try:
                while True:  # the replica must know the primary before it can follow it
                    try:
                        client.execute_command("CLUSTER", "REPLICATE", primary_id)
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.1)
                while client.info("replication").get("master_link_status") != "up":
                    if time.monotonic() > deadline:
                        raise RuntimeError("a Cluster replica did not sync with its primary")
                    time.sleep(0.05)
            finally:
                client.close()

    def node_for_slot(self, slot: int) -> ClusterNode:
        """The primary that serves `slot` as the cluster was started (before any resharding)."""
        return next(
            n for n, first in reversed(list(zip(self.nodes, self.starts, strict=True))) if slot >= first
        )

    def stop(self) -> None:
        for node in [*self.nodes, *self.replicas]:
            node.kill()


@contextmanager
def running_cluster(workdir: Path) -> Iterator[RedisCluster]:
    cluster = RedisCluster(workdir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
