"""A Redis Cluster node by node: what a hung node costs a replica's calls, and what a lease's end
costs when it waits for a replica (broker/fleet/nodes.py).

    python -m bench.scale.cluster_nodes [--calls 40] [--out bench/results/scale-cluster-nodes.json]

Hung node: a real 3-primary Cluster; one replica's RedisState (the broker's store client) writes
a `{leases}` key, then the primary of `{leases}` is paused (SIGSTOP) for PAUSE_S and calls are made
back to back: to the paused node (our own connection, `state.command`) and to another primary.
Printed: the first call's time (the one that waits the 250 ms socket timeout), the median and
max of the later ones, the other node's median, and the time from SIGCONT to the first call that
succeeds. The same run with the breaker's check turned off (every call waits its timeout, as
before) is the baseline.

Durable wait: a Cluster with a replica per primary; a script on `{leases}` then `durable()` (WAIT 1
on that primary), against the same with no replica (no WAIT sent); median per lease end.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbroker.broker.errors import Unavailable
from kvbroker.broker.fleet.conn import RedisState
from testkit.redis_cluster import RedisCluster

LEASES_SLOT = 14949
PAUSE_S = 1.2  # under the Cluster's node timeout (2 s): the node is not failed over meanwhile
_SET = "redis.call('SET', KEYS[1], ARGV[1]) return 1"


def _timed(call: Any) -> tuple[float, bool]:
    started = time.perf_counter()
    try:
        call()
        ok = True
    except Unavailable:
        ok = False
    return time.perf_counter() - started, ok


def hung_node(cluster: RedisCluster, calls: int, breaker: bool) -> dict[str, Any]:
    state = RedisState(cluster.url, prefix=f"b{secrets.token_hex(4)}")
    if not breaker:
        state.nodes.check = lambda name: None  # type: ignore[method-assign]
    node = cluster.node_for_slot(LEASES_SLOT)
    assert node.proc is not None
    pid = node.proc.pid
    try:
        state.command("SET", "{leases}x", "1")
        os.kill(pid, signal.SIGSTOP)
        paused = time.monotonic()
        try:
            first, _ = _timed(lambda: state.command("GET", "{leases}x"))
            hung: list[tuple[float, bool]] = []
            other: list[tuple[float, bool]] = []
            while len(hung) < calls and time.monotonic() - paused < PAUSE_S:
                hung.append(_timed(lambda: state.command("GET", "{leases}x")))
                other.append(_timed(lambda: state.command("GET", "{fleet}x")))
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        while not _timed(lambda: state.command("GET", "{leases}x"))[1]:
            time.sleep(0.005)
        return {
            "breaker": breaker,
            "first_call_ms": round(first * 1000, 1),
            "calls_during_pause": len(hung),
            "hung_node_unavailable": sum(not ok for _, ok in hung),
            "hung_node_median_ms": round(statistics.median(t for t, _ in hung) * 1000, 3),
            "hung_node_max_ms": round(max(t for t, _ in hung) * 1000, 3),
            "other_node_answered": sum(ok for _, ok in other),
            "other_node_median_ms": round(statistics.median(t for t, _ in other) * 1000, 3),
            "back_after_sigcont_ms": round((time.monotonic() - resumed) * 1000, 1),
        }
    finally:
        state.close()


def lease_end(cluster: RedisCluster, n: int) -> dict[str, Any]:
    state = RedisState(cluster.url, prefix=f"b{secrets.token_hex(4)}")
    script = state.script(_SET)
    times = []
    try:
        for i in range(n):
            started = time.perf_counter()
            state.run(script, ["{leases}end"], [str(i)])
            assert state.durable()
            times.append(time.perf_counter() - started)
        return {
            "replicas": bool(cluster.replicas),
            "lease_end_median_ms": round(statistics.median(times) * 1000, 3),
        }
    finally:
        state.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="calls to the paused node per run")
    parser.add_argument("--out", default="bench/results/scale-cluster-nodes.json")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for replicas in (False, True):
            cluster = RedisCluster(Path(tmp) / f"c{int(replicas)}", with_replicas=replicas)
            try:
                cluster.start(timeout=40.0)
                if not replicas:
                    rows += [hung_node(cluster, args.calls, breaker) for breaker in (False, True)]
                rows.append(lease_end(cluster, 500))
            finally:
                cluster.stop()
    load = os.getloadavg()
    result = {"load_average": [round(x, 2) for x in load], "cores": os.cpu_count(), "rows": rows}
    for row in rows:
        print(json.dumps(row))
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
