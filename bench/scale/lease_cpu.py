"""Broker CPU per lease cycle: two replicas over one Redis against the in-memory broker (issue 29's
1.5x goal), in a run of seconds.

Starts one in-memory `kvbroker serve` and two `kvbroker serve --state redis://...` replicas over a
private redis-server, and two engine sessions (Python clients) on each setup: the holder P on the
first replica, the reader D on the second, so every lease crosses replicas. A cycle is P's hold
naming D, D's acquire and D's release, one at a time, as in `bench.scale.replicas`. The setups
take turns (ROUNDS rounds of CYCLES cycles each, after a warm-up), so a change in the machine's
load falls on both; the figure is the CPU seconds (user + system, from /proc) the broker processes
used per cycle, which moves less with the load than wall time does, and the ratio of the medians.
The load average is printed beside it.

    python -m bench.scale.lease_cpu                       # 3 rounds of 1,000 cycles
    python -m bench.scale.lease_cpu --profile DIR         # also cProfile each replica (main thread)

`--profile` runs the replicas under cProfile (written at their graceful stop) and prints the top
functions by own time of the holder's replica; the CPU figures of that run include the profiler's
overhead, so they are not recorded. Writes bench/results/lease_cpu.json otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import pstats
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.harness.loops import cpu_seconds
from bench.harness.output import load_note, log, write_json
from bench.scale.chains import chains_for
from kvbroker.clients.clock import Backoff
from kvbroker.clients.engine_session import EngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.processes import SERVE, BrokerProcess
from testkit.redis_server import RedisServer, missing_reason

GPU = pb.TIER_GPU


class Setup:
    """A broker setup and its two sessions: P on the first address, D on the last."""

    def __init__(self, name: str, brokers: list[BrokerProcess]) -> None:
        self.name = name
        self.brokers = brokers
        self.per_cycle_us: list[float] = []
        self.p: EngineSession | None = None
        self.d: EngineSession | None = None

    async def open(self) -> None:
        addresses = [b.address for b in self.brokers]
        fast = Backoff(initial_s=0.05, max_s=0.5)
        self.p = EngineSession(",".join(addresses), engine_info("P"), ttl_ms=5_000, backoff=fast)
        self.d = EngineSession(",".join(reversed(addresses)), engine_info("D"), ttl_ms=5_000, backoff=fast)
        await self.p.start(wait_connected_s=10.0)
        await self.d.start(wait_connected_s=10.0)

    async def cycles(self, n: int, chains: list[list[int]]) -> float:
        """CPU seconds of the broker processes per cycle over `n` cycles."""
        assert self.p is not None and self.d is not None
        ns = (self.p.layout_id, "")
        pids = [b.pid for b in self.brokers]
        cpu0 = sum(cpu_seconds(pid) for pid in pids)
        for i in range(n):
            chain = chains[i % len(chains)][:8]
            held = await self.p.hold(ns, GPU, chain, list(range(8)), 30_000, reader_engine_id="D")
            acquired = await self.d.acquire(held.lease_id)
            await self.d.release(held.lease_id, acquired.lease.epoch)
        return (sum(cpu_seconds(pid) for pid in pids) - cpu0) / n

    async def close(self) -> None:
        for s in (self.p, self.d):
            if s is not None:
                await s.close()


# `kvbroker serve` under cProfile counting the main thread's CPU time (thread_time: not the gRPC
# threads' time while it waits), not wall time: a replica waits on
# Redis most of the wall time. Stats are written at its graceful stop (SIGTERM).
_PROFILED = """
import cProfile, runpy, sys, time
sys.argv = sys.argv[1:]
profile = cProfile.Profile(time.thread_time)
profile.enable()
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
finally:
    profile.disable()
    profile.dump_stats({out!r})
"""


def _broker(log_dir: Path, name: str, state: str, profile: Path | None) -> BrokerProcess:
    extra = ["--metrics-port", "0", "--log-level", "WARNING"]
    if state:
        extra += ["--state", state]
    command: tuple[str, ...] = SERVE
    if profile is not None:
        command = ("-c", _PROFILED.format(out=str(profile / f"{name}.prof")), *SERVE[1:])
    return BrokerProcess(
        log_dir, extra, command=command, log_name=f"{name}.log", log_level=None, priority=None
    )


def _top(path: Path, n: int) -> None:
    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(n)
    stats.sort_stats("cumulative").print_stats(n)


async def main_async(args: argparse.Namespace) -> int:
    reason = missing_reason()
    if reason:
        log(f"no redis-server: {reason}")
        return 1
    chains = chains_for(64 * 64)
    profile = Path(args.profile) if args.profile else None
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        store = RedisServer(log_dir / "redis")
        store.start()
        memory = Setup("in-memory", [_broker(log_dir, "memory", "", None)])
        replicas = Setup(
            "redis, 2 replicas", [_broker(log_dir, f"replica-{i}", store.url, profile) for i in range(2)]
        )
        setups = [memory, replicas]
        try:
            for s in setups:
                for b in s.brokers:
                    b.start()
                await s.open()
                await s.cycles(args.warmup, chains)
            loads = []
            for r in range(args.rounds):
                for s in setups if r % 2 == 0 else reversed(setups):
                    s.per_cycle_us.append(await s.cycles(args.cycles, chains) * 1e6)
                loads.append(load_note())
                log(f"round {r + 1}: " + ", ".join(f"{s.name} {s.per_cycle_us[-1]:,.0f} us" for s in setups))
        finally:
            for s in setups:
                await s.close()
                for b in s.brokers:
                    b.stop()
            store.stop()
    base = statistics.median(memory.per_cycle_us)
    two = statistics.median(replicas.per_cycle_us)
    ratio = two / base if base else float("nan")  # a run too short for one clock tick
    load = load_note()
    print(
        f"broker CPU per lease cycle (median of {args.rounds} rounds of {args.cycles:,}): in-memory "
        f"{base:,.0f} us, redis 2 replicas {two:,.0f} us (both replicas summed): {ratio:.2f}x "
        f"(load average: {load})"
    )
    if profile is not None:
        _top(profile / "replica-0.prof", args.top)
        return 0
    result: dict[str, Any] = {
        "load": load,
        "loads_per_round": loads,
        "settings": vars(args),
        "in_memory_us_per_cycle": memory.per_cycle_us,
        "two_replicas_us_per_cycle": replicas.per_cycle_us,
        "in_memory_median_us": base,
        "two_replicas_median_us": two,
        "ratio": ratio,
    }
    log(f"wrote {write_json(args.name, result, Path(args.out_dir) if args.out_dir else None)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=1_000, help="lease cycles per round and setup")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, setups taking turns")
    ap.add_argument("--warmup", type=int, default=200, help="cycles before measuring, per setup")
    ap.add_argument("--profile", default="", help="a folder: cProfile the replicas, print the holder's")
    ap.add_argument("--top", type=int, default=30, help="functions printed from the profile")
    ap.add_argument("--name", default="lease_cpu", help="bench/results/NAME.json")
    ap.add_argument("--out-dir", default="", help="write NAME.json here instead of bench/results")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
