"""Helpers shared by the benchmark programs: processes, workloads, load loops, statistics, output.

Latency is measured by closed-loop clients: each client issues one operation, waits
for the answer, and issues the next. A *run* gives p50/p99 latency over every
operation of every client and throughput (operations / wall time of the measured
phase). A benchmark repeats a run several times and reports the median of each
figure with its spread (min..max over the repetitions).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.checks import invalid_reason, is_invalid, little_law_reason, mark

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
CHAIN_LEN = 64
# The least a published block moves: its 64-bit hash (fixed64 on the wire).
BLOCK_WIRE_BYTES = 8


def shared_cores_note() -> str:
    cores = os.cpu_count() or 0
    return (
        f"clients and servers run on the same machine and share its {cores} CPU cores "
        "(loopback, Python clients); figures include client-side Python overhead"
    )


def load_note() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f} (1/5/15 min)"


# --------------------------------------------------------------------------- processes


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


class ManagedProcess:
    """A child process we started and must stop; output goes to a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(REPO_ROOT),
            env=env,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_for_port(self, port: int, timeout_s: float = 60.0, host: str = "127.0.0.1") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} before listening on "
                    f"{host}:{port}; log tail:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not listen on {host}:{port} within {timeout_s:.0f}s")

    def stop(self, grace_s: float = 5.0) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


# --------------------------------------------------------------------------- workload


def random_hashes(rng: random.Random, n: int) -> list[int]:
    """n random 64-bit block hashes (the wire form of vLLM's chained hashes)."""
    return [rng.getrandbits(64) for _ in range(n)]


def make_chains(n_chains: int, seed: int, length: int = CHAIN_LEN) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_hashes(rng, length) for _ in range(n_chains)]


def longest_prefix(found: Sequence[Any]) -> int:
    """Length of the leading run of truthy entries (the matched prefix of a chain)."""
    for i, x in enumerate(found):
        if not x:
            return i
    return len(found)


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

    Every run's throughput is checked against Little's law (bench.checks); a run
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


# --------------------------------------------------------------------------- output


def fmt_num(x: float, unit: str = "") -> str:
    if x != x:  # NaN
        return "-"
    if abs(x) >= 100:
        s = f"{x:,.0f}"
    elif abs(x) >= 10:
        s = f"{x:.1f}"
    else:
        s = f"{x:.2f}"
    return s + unit


THROUGHPUT_KEYS = ("ops_per_s", "blocks_per_s", "gb_per_s")


def fmt_spread(d: dict[str, Any] | None, key: str) -> str:
    m = med(d, key)
    lo, hi = spread(d, key)
    if m != m:
        return "-"
    text = f"{fmt_num(m)} [{fmt_num(lo)}..{fmt_num(hi)}]"
    if key in THROUGHPUT_KEYS and is_invalid(d):
        return f"INVALID {text} ({invalid_reason(d)})"
    return text


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([line, sep, *body])


def machine_info() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
                break
    return {
        "hostname_hidden": True,
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "mem_total_gib": round(mem_kb / 2**20, 1),
        # Other work on the machine skews every figure: keep the load beside the numbers.
        "loadavg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def write_json(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    out = out_dir or RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine_info(),
        "note": shared_cores_note(),
        **payload,
    }
    path = out / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def log(msg: str) -> None:
    """Progress lines go to stderr so the table on stdout stays clean."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
