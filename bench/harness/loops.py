"""Closed-loop load and the statistics over it, shared by the benchmark programs.

Latency is measured by closed-loop clients: each client issues one operation, waits
for the answer, and issues the next. A *run* gives p50/p99 latency over every
operation of every client and throughput (operations / wall time of the measured
phase). A benchmark repeats a run several times and reports the median of each
figure with its spread (min..max over the repetitions).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.harness.checks import little_law_reason, mark

# --------------------------------------------------------------------------- process figures


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process (all its threads) has used so far, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based, see proc(5)).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- load loops


@dataclass
class RunResult:
    latencies_s: list[float]
    wall_s: float
    server_cpu_s: float | None = None  # CPU the server process used during the measured phase
    clients: int = 1  # closed-loop clients that ran concurrently (for the Little's-law check)

    @property
    def ops(self) -> int:
        return len(self.latencies_s)

    def percentile_us(self, q: float) -> float:
        xs = sorted(self.latencies_s)
        if not xs:
            return float("nan")
        idx = min(len(xs) - 1, max(0, round(q / 100.0 * (len(xs) - 1))))
        return xs[idx] * 1e6

    def ops_per_s(self) -> float:
        return self.ops / self.wall_s if self.wall_s > 0 else float("nan")

    def mean_latency_s(self) -> float:
        return sum(self.latencies_s) / self.ops if self.ops else float("nan")

    def invalid_reason(self) -> str | None:
        """Why this run's throughput cannot be true (Little's law), or None."""
        return little_law_reason(self.ops_per_s(), self.clients, self.mean_latency_s())

    def summary(self) -> dict[str, float]:
        out = {
            "p50_us": self.percentile_us(50),
            "p99_us": self.percentile_us(99),
            "mean_us": self.mean_latency_s() * 1e6,
            "ops_per_s": self.ops_per_s(),
            "ops": float(self.ops),
        }
        if self.server_cpu_s is not None and self.ops:
            out["server_cpu_us_per_op"] = self.server_cpu_s / self.ops * 1e6
        return out


AsyncOp = Callable[[int], Awaitable[Any]]
SyncOp = Callable[[int], Any]


async def closed_loop_async(
    ops: Sequence[AsyncOp], ops_per_client: int, warmup: int, server_pid: int | None = None
) -> RunResult:
    """One asyncio task per entry of ``ops``; each calls its op(i) in a closed loop.

    All clients warm up, meet, and then run ``ops_per_client`` measured operations.
    With ``server_pid``, the server's CPU time over the measured phase is recorded too.
    """
    start = asyncio.Event()
    ready = 0
    lat: list[float] = []
    t0 = 0.0
    cpu0 = 0.0

    async def client(op: AsyncOp, cid: int) -> None:
        nonlocal ready, t0, cpu0
        for i in range(warmup):
            await op(cid * 7919 + i)
        ready += 1
        if ready == len(ops):
            cpu0 = cpu_seconds(server_pid) if server_pid else 0.0
            t0 = time.perf_counter()
            start.set()
        await start.wait()
        mine = []
        pc = time.perf_counter
        for i in range(ops_per_client):
            t = pc()
            await op(cid * 7919 + warmup + i)
            mine.append(pc() - t)
        lat.extend(mine)

    await asyncio.gather(*(client(op, i) for i, op in enumerate(ops)))
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(server_pid) - cpu0 if server_pid else None
    return RunResult(lat, wall, cpu, clients=len(ops))


def closed_loop_threads(
    ops: Sequence[SyncOp], ops_per_client: int, warmup: int, server_pid: int | None = None
) -> RunResult:
    """The same as closed_loop_async with one OS thread per client (for blocking client libraries).

    The clock starts in the barrier's action, which runs once every client has warmed
    up and before any of them is released. (Reading it in the main thread after the
    barrier, as this did before, raced with the clients: they hold the GIL for up to
    a switch interval, so several could finish all their measured operations before
    the main thread read the clock, and the wall time missed most of the work.)
    """
    clock: dict[str, float] = {}

    def start_clock() -> None:
        clock["cpu0"] = cpu_seconds(server_pid) if server_pid else 0.0
        clock["t0"] = time.perf_counter()

    barrier = threading.Barrier(len(ops), action=start_clock)
    results: list[list[float]] = [[] for _ in ops]
    errors: list[BaseException] = []

    def client(op: SyncOp, cid: int) -> None:
        try:
            for i in range(warmup):
                op(cid * 7919 + i)
        except BaseException as e:
            errors.append(e)
        barrier.wait()
        if errors:
            return
        pc = time.perf_counter
        mine = results[cid]
        try:
            for i in range(ops_per_client):
                t = pc()
                op(cid * 7919 + warmup + i)
                mine.append(pc() - t)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(op, i), daemon=True) for i, op in enumerate(ops)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - clock["t0"]
    cpu = cpu_seconds(server_pid) - clock["cpu0"] if server_pid else None
    if errors:
        raise errors[0]
    return RunResult([x for r in results for x in r], wall, cpu, clients=len(ops))


# --------------------------------------------------------------------------- statistics


@dataclass
class Figure:
    """One figure measured in several repetitions: median and spread."""

    values: list[float] = field(default_factory=list)

    def add(self, v: float) -> None:
        self.values.append(v)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    def to_json(self) -> dict[str, Any]:
        if not self.values:
            return {"median": None, "min": None, "max": None, "runs": []}
        return {
            "median": self.median,
            "min": min(self.values),
            "max": max(self.values),
            "runs": self.values,
        }


def aggregate(runs: Sequence[RunResult], in_process: bool = False) -> dict[str, Any]:
    """Median and spread over repetitions of p50, p99, mean latency and throughput.

    Every run's throughput is checked against Little's law (bench.harness.checks); a run
    that fails marks the whole figure invalid, with the reason. ``in_process``
    says the work is CPU-bound in this process, for the cores check that
    bench.checks.validate_results makes against the 1-client figure.
    """
    figs: dict[str, Figure] = {
        "p50_us": Figure(),
        "p99_us": Figure(),
        "mean_us": Figure(),
        "ops_per_s": Figure(),
    }
    if runs and all(r.server_cpu_s is not None for r in runs):
        figs["server_cpu_us_per_op"] = Figure()
    for r in runs:
        s = r.summary()
        for k, f in figs.items():
            f.add(s[k])
    out: dict[str, Any] = {k: f.to_json() for k, f in figs.items()}
    out["clients"] = runs[0].clients if runs else 0
    if in_process:
        out["in_process"] = True
    for r in runs:
        why = r.invalid_reason()
        if why:
            mark(out, why)
    return out


def med(d: dict[str, Any] | None, key: str) -> float:
    """Median of figure ``key`` in an aggregate (NaN when missing)."""
    if not d or key not in d or d[key].get("median") is None:
        return float("nan")
    return float(d[key]["median"])


def spread(d: dict[str, Any] | None, key: str) -> tuple[float, float]:
    if not d or key not in d or d[key].get("min") is None:
        return (float("nan"), float("nan"))
    return (float(d[key]["min"]), float(d[key]["max"]))
