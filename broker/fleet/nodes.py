"""What a replica knows about each node of a Redis Cluster: which ones hang, which have replicas.

**A hung node fails fast.** On a single Redis, ``StoreHealth`` turns a store
that stops answering into Unavailable at once after one call's timeout. On a
Cluster a node that hangs (paused, partitioned: no reset) is one slot range
away, not the whole store, so the same rule applies per node: the first call
to it that times out marks *that node* suspect, every later call routed to it
(our own connections, the client's commands, pipelines) is Unavailable at once
without touching a socket, and calls to the other nodes go on. A probe thread,
off the event loop, pings the node on a connection of its own every
``PROBE_EVERY_S`` and closes the breaker at the first answer; while the node is
suspect it also refreshes the client's slot map every ``REFRESH_EVERY_S``, so a
replica the Cluster promoted in the hung primary's place is found without
waiting for the old primary to answer.

**A lease's end waits for a replica where there is one.** Before the parties
of a lease are told it ended, the end must be on a replica of the primary that
holds it (``WAIT``, see ``RedisState.durable``); a primary with no replica
would make ``WAIT 1`` block its whole timeout for nothing. How many replicas
each primary has online is read from its ``INFO replication`` and kept for
``REPLICAS_TTL_S``: a replica added or lost is noticed within a second.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from kvbroker.broker.fleet.health import StoreHealth

REFRESH_EVERY_S = 0.5
REPLICAS_TTL_S = 1.0


def online_replicas(info: dict[str, Any]) -> int:
    """Replicas in sync with a primary, from its parsed ``INFO replication`` (slaveN: state=online)."""
    return sum(
        1
        for key, value in info.items()
        if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
    )


class ClusterNodes:
    """Per-node breakers and replica counts; thread-safe (the probes run on threads of their own)."""

    def __init__(
        self,
        shown: str,
        connect: Callable[[str, int], redis.Redis],
        refresh_slots: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shown = shown
        self._connect = connect  # a client of its own to one node, for the probes
        self._refresh_slots = refresh_slots
        self._clock = clock
        self._lock = threading.Lock()
        self._health: dict[str, StoreHealth] = {}
        self._probers: dict[str, redis.Redis] = {}
        self._refreshed = -math.inf
        self._replicas: dict[str, tuple[int, float]] = {}

    def check(self, name: str) -> None:
        """Unavailable at once while node `name` ("host:port") is suspect."""
        health = self._health.get(name)
        if health is not None:
            health.check()

    def failed(self, name: str, cause: str) -> None:
        """A call to node `name` timed out: suspect until its probe gets an answer."""
        with self._lock:
            health = self._health.get(name)
            if health is None:
                health = StoreHealth(f"{self.shown} (node {name})", lambda: self._probe(name), self._clock)
                self._health[name] = health
        health.failed(cause)

    def suspects(self) -> list[str]:
        return [name for name, health in list(self._health.items()) if health.away]

    def back_for(self) -> float:
        """Seconds since the last node that was suspect answered again (inf if none ever was)."""
        return min((h.back_for() for h in list(self._health.values())), default=math.inf)

    def _probe(self, name: str) -> None:
        now = self._clock()
        if now - self._refreshed > REFRESH_EVERY_S:
            self._refreshed = now
            # The Cluster may have promoted a replica in its place; a refresh that fails waits its turn.
            with contextlib.suppress(Exception):
                self._refresh_slots()
        prober = self._probers.get(name)
        if prober is None:
            host, _, port = name.rpartition(":")
            prober = self._probers[name] = self._connect(host, int(port))
        prober.ping()

    def replicas(self, name: str, count: Callable[[], int]) -> int:
        """How many replicas node `name` has online: `count()` at most every REPLICAS_TTL_S."""
        now = self._clock()
        cached = self._replicas.get(name)
        if cached is not None and now - cached[1] < REPLICAS_TTL_S:
            return cached[0]
        n = count()
        self._replicas[name] = (n, now)
        return n

    def close(self) -> None:
        for health in list(self._health.values()):
            health.close()
        for prober in list(self._probers.values()):
            prober.close()

    def guard(self, client: Any) -> None:
        """Route the cluster client's own commands and pipelines through the breakers: a suspect
        node's calls are Unavailable before a connection is taken, and a timeout marks its node.
        (A pipeline here touches one hash slot, so it stops before taking any connection.)
        This wraps redis-py's per-node seams (RedisCluster._execute_command(target_node, ...) and a
        pipeline's get_redis_connection(node)); tests/broker/fleet/test_cluster_nodes.py fails if
        an upgrade moves them."""
        execute = client._execute_command

        def execute_guarded(target_node: Any, *args: Any, **kwargs: Any) -> Any:
            self.check(target_node.name)
            try:
                return execute(target_node, *args, **kwargs)
            except redis.TimeoutError as err:
                self.failed(target_node.name, f"TimeoutError: {err}")
                raise

        pipeline = client.pipeline

        def pipeline_guarded(*args: Any, **kwargs: Any) -> Any:
            pipe = pipeline(*args, **kwargs)
            connection_of = pipe.get_redis_connection

            def connection_checked(node: Any) -> Any:
                self.check(node.name)
                return connection_of(node)

            pipe.get_redis_connection = connection_checked
            return pipe

        client._execute_command = execute_guarded
        client.pipeline = pipeline_guarded
