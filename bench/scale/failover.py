"""Failover of broker replicas, three ways side by side: kill -9, SIGSTOP and a blackholed link.

For each fault, a fresh fleet: two `kvbroker serve --state redis://...` replicas over
a private redis-server, HOLDERS engine sessions (session TTL 2 s) that name replica
a first (through a TCP proxy for the blackhole, testkit/tcp_proxy.py), and one reader
on replica b. Each holder holds a lease its reader acquires; then the fault hits
replica a, and each holder's time from the fault to its session registered on b is
recorded (the service it lost), with whether it resumed the same session. Then the
reader releases every lease: one that does not commit is a lease lost. Used by
bench.scale.replicas (a helper module, not a program).
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbroker.clients import errors
from kvbroker.clients.clock import Backoff
from kvbroker.clients.engine_session import EngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.processes import SERVE, BrokerProcess
from testkit.redis_server import RedisServer
from testkit.tcp_proxy import TcpProxy

FAULTS = ("kill -9", "SIGSTOP", "blackhole")
TTL_MS = 2_000
GPU = pb.TIER_GPU


def _replica(folder: Path, name: str, url: str) -> BrokerProcess:
    args = ["--state", url, "--metrics-port", "0", "--log-level", "WARNING", "--session-ttl-min-ms", "100"]
    return BrokerProcess(folder, args, command=SERVE, log_name=f"{name}.log", log_level=None, priority=None)


def _recorder(log: list[tuple[float, bool]]) -> Callable[[pb.Registered], None]:
    return lambda registered: log.append((time.monotonic(), registered.resumed))


async def one_fault(fault: str, holders: int, folder: Path) -> dict[str, Any]:
    store = RedisServer(folder / "redis")
    store.start()
    a, b = _replica(folder, "a", store.url).start(), _replica(folder, "b", store.url).start()
    proxy = TcpProxy(a.address).start()
    first = proxy.address if fault == "blackhole" else a.address
    fast = Backoff(initial_s=0.05, max_s=0.5)
    moved: dict[str, list[tuple[float, bool]]] = {}
    sessions: list[EngineSession] = []
    stopped = False
    try:
        reader = EngineSession(f"{b.address},{first}", engine_info("D"), ttl_ms=TTL_MS, backoff=fast)
        sessions.append(reader)
        await reader.start(wait_connected_s=20.0)
        leases: list[tuple[str, int]] = []
        for i in range(holders):
            engine_id = f"P{i}"
            moved[engine_id] = []
            holder = EngineSession(
                f"{first},{b.address}",
                engine_info(engine_id),
                ttl_ms=TTL_MS,
                backoff=fast,
                on_connected=_recorder(moved[engine_id]),
            )
            sessions.append(holder)
            await holder.start(wait_connected_s=20.0)
            ns = (holder.layout_id, "")
            hashes = [1000 * (i + 1) + k for k in range(4)]
            holder.announce_stored(ns, GPU, hashes)
            await holder.applied()
            held = await holder.hold(ns, GPU, hashes, [0, 1, 2, 3], 60_000, reader_engine_id="D")
            leases.append((held.lease_id, (await reader.acquire(held.lease_id)).lease.epoch))
        at = time.monotonic()
        if fault == "kill -9":
            await asyncio.to_thread(a.kill9)
        elif fault == "SIGSTOP":
            os.kill(a.pid, signal.SIGSTOP)
            stopped = True
        else:
            proxy.blackhole()
        deadline = at + 15.0
        while time.monotonic() < deadline and any(len(log) < 2 for log in moved.values()):
            await asyncio.sleep(0.005)
        times = [log[1][0] - at for log in moved.values() if len(log) >= 2]
        resumed = sum(1 for log in moved.values() if len(log) >= 2 and log[1][1])
        lost = 0
        for lease_id, epoch in leases:
            try:
                if (await reader.release(lease_id, epoch)).state != pb.LEASE_RELEASED:
                    lost += 1
            except errors.BrokerError:
                lost += 1
        return {
            "fault": fault,
            "engines": holders,
            "moved": len(times),
            "resumed": resumed,
            "failover_p50_s": statistics.median(times) if times else None,
            "failover_max_s": max(times) if times else None,
            "leases_lost": lost,
        }
    finally:
        if stopped:
            os.kill(a.pid, signal.SIGCONT)
        for session in sessions:
            await session.close()
        proxy.close()
        for broker in (a, b):
            broker.stop()
        store.stop()


async def failover_side_by_side(holders: int) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for fault in FAULTS:
            results.append(await one_fault(fault, holders, Path(tmp) / fault.replace(" ", "")))
    return results


def rows(results: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["fault (replica a)", "engines", "moved / resumed", "failover p50", "max", "leases lost"]
    out = []
    for r in results:
        p50, worst = r["failover_p50_s"], r["failover_max_s"]
        out.append(
            [
                r["fault"],
                str(r["engines"]),
                f"{r['moved']} / {r['resumed']}",
                "-" if p50 is None else f"{p50 * 1000:,.0f} ms",
                "-" if worst is None else f"{worst * 1000:,.0f} ms",
                str(r["leases_lost"]),
            ]
        )
    return headers, out
