"""Scale-out side by side, in one run: one in-memory broker against 1, 2 and 4 replicas over one
Redis, and 2 replicas over a 3-primary Redis Cluster.

Starts everything on loopback: a private redis-server (Debian's binary), or three
of them as a Cluster, and `kvbroker serve` processes (`--state redis://...` or
`--state redis+cluster://...` for the replicas). On each setup the same
workload, through real engine sessions (Python clients):

- inventory: a holder announces BLOCKS blocks (64-block chains); blocks/s, and
  memory per indexed block (in-memory: the broker's RSS growth; Redis: its
  used_memory growth);
- resolve over the session stream (the path without a mirror): a reader asks
  for a held 64-block chain, one at a time; p50/p99;
- resolve on the engine's own Mirror (clients/mirror.py), following the
  reader's replica from before the inventory: the same chains answered in
  process; p50/p99 and CPU per resolve (this process's);
- leases: hold (holder) + acquire + release (reader), one cycle at a time;
  cycles/s, and CPU seconds per cycle in the broker processes and in Redis
  (from /proc; on a Cluster summed over its primaries, and per primary);
- failover (2 or more replicas): kill -9 the holder's replica; time until its
  session is resumed on the next one;
- failover side by side (bench/scale/failover.py): kill -9, SIGSTOP and a
  blackholed link of a replica serving FAILOVER_ENGINES holders (session TTL
  2 s), each on a fresh fleet: per-engine time to resumed, leases lost.

With several replicas the holder and the reader are on different replicas, so
every lease crosses them. This machine's cores are shared by clients and
servers: capacity beyond it is projected from CPU per operation, and the JSON's
`projections` say so (docs/scale.md).

    python -m bench.scale.replicas            # BLOCKS=200000
    python -m bench.scale.replicas --quick    # smaller, ~1 minute
    python -m bench.scale.replicas --failover-only   # only the three failovers side by side

Writes bench/results/scale.json (scale-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.harness.loops import cpu_seconds, rss_bytes
from bench.harness.output import format_table, load_note, log, write_json
from bench.scale.chains import CHAIN, chains_for
from bench.scale.failover import failover_side_by_side
from bench.scale.failover import rows as failover_rows
from kvbroker.clients.clock import Backoff
from kvbroker.clients.engine_session import EngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.processes import SERVE, BrokerProcess
from testkit.redis_cluster import RedisCluster
from testkit.redis_server import RedisServer, missing_reason

Store = RedisServer | RedisCluster

GPU = pb.TIER_GPU


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def _store_pids(store: Store | None) -> list[int]:
    if isinstance(store, RedisCluster):
        return [n.proc.pid for n in store.nodes if n.proc is not None]
    return [store.proc.pid] if store is not None and store.proc is not None else []


def _store_memory(store: Store) -> int:
    """used_memory, summed over a Cluster's primaries."""
    if isinstance(store, RedisCluster):
        clients = [n.client() for n in store.nodes]
    else:
        clients = [redis.Redis.from_url(store.url)]
    used = sum(int(c.info("memory")["used_memory"]) for c in clients)
    for c in clients:
        c.close()
    return used


async def _measure(
    name: str,
    addresses: list[str],
    brokers: list[BrokerProcess],
    store: Store | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    chains = chains_for(args.blocks)
    fast = Backoff(initial_s=0.05, max_s=0.5)
    moved: list[float] = []
    p = EngineSession(",".join(addresses), engine_info("P"), ttl_ms=5_000, backoff=fast)
    p.on_connected = lambda _r: moved.append(time.monotonic())
    d = EngineSession(",".join(reversed(addresses)), engine_info("D"), ttl_ms=5_000, backoff=fast)
    await p.start(wait_connected_s=10.0)
    await d.start(wait_connected_s=10.0)
    ns = (p.layout_id, "")
    pids = [b.pid for b in brokers]
    store_pids = _store_pids(store)
    out: dict[str, Any] = {"setup": name, "replicas": len(brokers), "blocks": len(chains) * CHAIN}
    if isinstance(store, RedisCluster):
        out["redis_primaries"] = len(store.nodes)

    mirror = await _start_mirror(addresses[-1], p.layout_id, args)

    # -- inventory and memory per block
    rss0 = sum(rss_bytes(pid) for pid in pids)
    mem0 = _store_memory(store) if store is not None else 0
    started = time.perf_counter()
    for i in range(0, len(chains), 16):
        for chain in chains[i : i + 16]:
            p.announce_stored(ns, GPU, chain)
        await p.applied(timeout=60.0)
    elapsed = time.perf_counter() - started
    out["inventory_blocks_per_s"] = out["blocks"] / elapsed
    out["broker_rss_bytes_per_block"] = (sum(rss_bytes(pid) for pid in pids) - rss0) / out["blocks"]
    if store is not None:
        out["redis_bytes_per_block"] = (_store_memory(store) - mem0) / out["blocks"]

    # -- resolve over the session stream
    cpu0 = _cpu(pids)
    rcpu0 = [cpu_seconds(pid) for pid in store_pids]
    times: list[float] = []
    for i in range(args.resolves):
        chain = chains[i % len(chains)]
        t0 = time.perf_counter()
        found = await d.resolve(ns, chain)
        times.append(time.perf_counter() - t0)
        assert found.matches and found.matches[0].matched_blocks == CHAIN, found
    out["resolve_p50_us"] = statistics.median(times) * 1e6
    out["resolve_p99_us"] = _pct(times, 0.99) * 1e6
    out["broker_cpu_us_per_resolve"] = (_cpu(pids) - cpu0) / args.resolves * 1e6
    if store_pids:
        per_node = [
            (cpu_seconds(pid) - c0) / args.resolves * 1e6 for pid, c0 in zip(store_pids, rcpu0, strict=True)
        ]
        out["redis_cpu_us_per_resolve"] = sum(per_node)
        out["redis_cpu_us_per_resolve_per_node"] = per_node

    # -- resolve on the engine's own synced mirror (the default path once synced): in process
    await _measure_mirror(mirror, out)

    # -- leases: hold + acquire + release
    cpu0 = _cpu(pids)
    rcpu0 = [cpu_seconds(pid) for pid in store_pids]
    cycles = 0
    started = time.perf_counter()
    while time.perf_counter() - started < args.lease_seconds:
        chain = chains[cycles % len(chains)][:8]
        held = await p.hold(ns, GPU, chain, list(range(8)), 30_000, reader_engine_id="D")
        acquired = await d.acquire(held.lease_id)
        await d.release(held.lease_id, acquired.lease.epoch)
        cycles += 1
    elapsed = time.perf_counter() - started
    out["lease_cycles_per_s"] = cycles / elapsed
    out["broker_cpu_us_per_lease_cycle"] = (_cpu(pids) - cpu0) / cycles * 1e6
    if store_pids:
        per_node = [(cpu_seconds(pid) - c0) / cycles * 1e6 for pid, c0 in zip(store_pids, rcpu0, strict=True)]
        out["redis_cpu_us_per_lease_cycle"] = sum(per_node)
        out["redis_cpu_us_per_lease_cycle_per_node"] = per_node

    # -- failover
    if len(brokers) > 1:
        before = len(moved)
        killed = time.monotonic()
        await asyncio.to_thread(brokers[0].kill9)  # reaping it must not stall this loop
        while len(moved) == before and time.monotonic() - killed < 10.0:
            await asyncio.sleep(0.002)
        out["failover_s"] = moved[-1] - killed if len(moved) > before else None
        out["failover_resumed"] = bool(p.registered is not None and p.registered.resumed)
    await p.close()
    await d.close()
    return out


async def _start_mirror(address: str, layout_id: str, args: argparse.Namespace) -> asyncio.subprocess.Process:
    """The reader's Mirror (clients/mirror.py) in a process of its own (bench/scale/mirror.py),
    following the replica the reader uses (with several, not the holder's: the holder's changes
    reach it over the store). Started before the inventory, as an engine's mirror is, so the
    blocks arrive as changes, in the order announced."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.scale.mirror",
        address,
        layout_id,
        str(args.blocks // CHAIN * CHAIN),
        str(args.resolves * 10),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdout is not None
    line = await asyncio.wait_for(child.stdout.readline(), 60.0)
    if line.strip() != b"synced":
        raise RuntimeError(f"mirror process: {line!r}")
    return child


async def _measure_mirror(child: asyncio.subprocess.Process, out: dict[str, Any]) -> None:
    """Resolves on the engine's own mirror, in its process, asker given as the engine adapter
    does: p50/p99 per resolve, and its CPU per resolve (steadier on a shared machine)."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(b"go\n")
    await child.stdin.drain()
    line = await asyncio.wait_for(child.stdout.readline(), 120.0)
    await child.wait()
    if child.returncode != 0 or not line:
        raise RuntimeError(f"mirror process failed ({child.returncode})")
    out.update(json.loads(line))


def _broker(log_dir: Path, name: str, state: str) -> BrokerProcess:
    extra = ["--metrics-port", "0", "--log-level", "WARNING"]
    if state:
        extra += ["--state", state]
    return BrokerProcess(log_dir, extra, command=SERVE, log_name=f"{name}.log", log_level=None, priority=None)


async def _setup(
    name: str, log_dir: Path, replicas: int, cluster: bool, args: argparse.Namespace
) -> dict[str, Any]:
    folder = log_dir / f"redis-{name.replace(' ', '').replace(',', '-')}"
    store: Store | None = None
    if replicas:
        store = RedisCluster(folder) if cluster else RedisServer(folder)
    if store is not None:
        store.start()
    brokers = [_broker(log_dir, f"{name}-{i}", store.url if store else "") for i in range(max(1, replicas))]
    try:
        for b in brokers:
            b.start()
        log(f"{name}: measuring")
        return await _measure(name, [b.address for b in brokers], brokers, store, args)
    finally:
        for b in brokers:
            b.stop()
        if store is not None:
            store.stop()


async def main_async(args: argparse.Namespace) -> int:
    reason = missing_reason()
    setups: list[tuple[str, int, bool]] = [("in-memory", 0, False)]
    if reason:
        log(f"Redis setups skipped: {reason}")
    else:
        setups += [
            ("redis, 1 replica", 1, False),
            ("redis, 2 replicas", 2, False),
            ("redis, 4 replicas", 4, False),
            ("cluster (3 primaries), 2 replicas", 2, True),
        ]
    if args.failover_only:
        setups = []
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, replicas, cluster in setups:
            results.append(await _setup(name, Path(tmp), replicas, cluster, args))
    failovers = [] if reason else await failover_side_by_side(args.failover_engines)
    if failovers:
        print(format_table(*failover_rows(failovers)))
        print(f"failovers: session TTL 2 s, two replicas over one Redis; load average: {load_note()}")
    if not results:
        path = write_json("scale-failover", {"load": load_note(), "failovers": failovers})
        log(f"wrote {path}")
        return 0
    base = results[0]
    rows = []
    for r in results:
        rows.append(
            [
                r["setup"],
                f"{r['inventory_blocks_per_s']:,.0f}",
                f"{r['resolve_p50_us']:,.0f} / {r['resolve_p99_us']:,.0f}",
                f"{r['mirror_resolve_p50_us']:,.1f} / {r['mirror_resolve_p99_us']:,.1f}",
                f"{r['mirror_cpu_us_per_resolve']:,.1f}",
                f"{r['broker_cpu_us_per_resolve']:,.0f} ({r['broker_cpu_us_per_resolve'] / base['broker_cpu_us_per_resolve']:.2f}x)",
                f"{r.get('redis_cpu_us_per_resolve', 0):,.0f}",
                f"{r['lease_cycles_per_s']:,.0f}",
                f"{r['broker_cpu_us_per_lease_cycle']:,.0f} ({r['broker_cpu_us_per_lease_cycle'] / base['broker_cpu_us_per_lease_cycle']:.2f}x)",
                f"{r.get('redis_cpu_us_per_lease_cycle', 0):,.0f}",
                f"{r.get('redis_bytes_per_block', r['broker_rss_bytes_per_block']):,.0f}",
                "-" if r.get("failover_s") is None else f"{r['failover_s'] * 1000:,.0f} ms",
            ]
        )
    headers = [
        "setup",
        "inventory blocks/s",
        "resolve p50/p99 us",
        "mirror resolve p50/p99 us",
        "mirror CPU us/resolve",
        "broker CPU us/resolve",
        "Redis CPU us/resolve",
        "lease cycles/s",
        "broker CPU us/cycle",
        "Redis CPU us/cycle",
        "bytes/block",
        "failover",
    ]
    print(format_table(headers, rows))
    print(
        f"load average: {load_note()}; bytes/block: broker RSS growth in memory, Redis used_memory growth else"
    )
    ratios = ", ".join(
        f"{r['setup']} {r['broker_cpu_us_per_lease_cycle'] / base['broker_cpu_us_per_lease_cycle']:.2f}x"
        for r in results[1:]
    )
    print(f"broker CPU per lease cycle against the in-memory broker: {ratios} (load average: {load_note()})")
    projections = _projections(results)
    for line in projections["lines"]:
        print(line)
    name = "scale-quick" if args.quick else "scale"
    path = write_json(
        name,
        {
            "load": load_note(),
            "settings": vars(args),
            "setups": results,
            "projections": projections,
            "failovers": failovers,
            "skipped": reason,
        },
    )
    log(f"wrote {path}")
    return 0


def _projections(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Operations per second per core at the measured CPU per operation: a PROJECTION (no larger
    fleet was run). A replica's core adds 1 / (broker CPU per operation, summed over the replicas
    it crossed) to the fleet's rate, if engines spread evenly; a Redis primary runs commands on one
    core, so the busiest primary bounds the rate (on a Cluster all lease keys share one primary).
    """
    per_setup = []
    lines = ["projections from CPU per operation (not measured at that scale):"]
    for r in results:
        row: dict[str, Any] = {
            "setup": r["setup"],
            "resolves_per_s_per_replica_core": 1e6 / r["broker_cpu_us_per_resolve"],
            "lease_cycles_per_s_per_replica_core": 1e6 / r["broker_cpu_us_per_lease_cycle"],
        }
        if r.get("redis_cpu_us_per_resolve"):
            busiest_resolve = max(r["redis_cpu_us_per_resolve_per_node"])
            busiest_lease = max(r["redis_cpu_us_per_lease_cycle_per_node"])
            row["resolves_per_s_per_redis_primary"] = 1e6 / max(busiest_resolve, 1e-9)
            row["lease_cycles_per_s_per_redis_primary"] = 1e6 / max(busiest_lease, 1e-9)
        per_setup.append(row)
        text = f"  {r['setup']}: a replica core ~{row['resolves_per_s_per_replica_core']:,.0f} resolves/s or "
        text += f"~{row['lease_cycles_per_s_per_replica_core']:,.0f} lease cycles/s"
        if "resolves_per_s_per_redis_primary" in row:
            text += f"; the busiest Redis primary ~{row['resolves_per_s_per_redis_primary']:,.0f} resolves/s "
            text += f"or ~{row['lease_cycles_per_s_per_redis_primary']:,.0f} lease cycles/s"
        lines.append(text)
    return {
        "kind": "projection from measured CPU per operation, not a measurement",
        "setups": per_setup,
        "lines": lines,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (about a minute)")
    ap.add_argument("--blocks", type=int, default=None, help="blocks announced (default 200000; quick 50000)")
    ap.add_argument("--resolves", type=int, default=None, help="resolves timed (default 3000; quick 500)")
    ap.add_argument(
        "--lease-seconds", type=float, default=None, help="seconds of lease cycles (default 10; quick 3)"
    )
    ap.add_argument(
        "--failover-only", action="store_true", help="only kill -9, SIGSTOP and blackhole side by side"
    )
    ap.add_argument("--failover-engines", type=int, default=8, help="holder sessions on the failing replica")
    args = ap.parse_args()
    args.blocks = args.blocks or (50_000 if args.quick else 200_000)
    args.resolves = args.resolves or (500 if args.quick else 3_000)
    args.lease_seconds = args.lease_seconds or (3.0 if args.quick else 10.0)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
