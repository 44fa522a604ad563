"""Broker CPU per lease cycle: two replicas over one Redis against the in-memory broker (issue 29's
1.5x goal), in a run of seconds.

Starts one in-memory `kvbroker serve` and two `kvbroker serve --state redis://...` replicas over a
private redis-server, and two engine sessions (Python clients) on each setup: the holder P on the
first replica, the reader D on the second, so every lease crosses replicas. A cycle is P's hold
naming D, D's acquire and D's release, one at a time, as in `bench.scale.replicas` (with
`--pairs N`, N such pairs cycle at the same time, each one cycle at a time: as engines do under
concurrent load, where one wake-up of a broker's event loop serves several messages). The setups
take turns (ROUNDS rounds of CYCLES cycles each, after a warm-up), so a change in the machine's
load falls on both; the figure is the CPU seconds (user + system, from /proc) the broker processes
used per cycle, which moves less with the load than wall time does, and the ratio of the medians.
The load average is printed beside it, and each broker's main thread (its event loop): its CPU per
cycle and how often it slept per cycle (what the figure mostly follows: docs/scale.md).

    python -m bench.scale.lease_cpu                       # 3 rounds of 1,000 cycles
    python -m bench.scale.lease_cpu --profile DIR         # also cProfile each broker (main thread)
    python -m bench.scale.lease_cpu --before ../base      # older code's replicas taking turns too
    python -m bench.scale.lease_cpu --one-replica         # and both sessions on one replica
    python -m bench.scale.lease_cpu --pairs 8 --name lease_cpu-8pairs   # 8 P/D pairs cycling at once

`--profile` runs the replicas and the in-memory broker under cProfile (DIR/replica-0.prof,
replica-1.prof and memory.prof, written at their graceful stop, so that a function's cost can be
set beside the in-memory broker's) and prints the top functions by own time of the holder's
replica; the CPU figures of that run include the profiler's overhead, so they are not recorded.
Writes bench/results/lease_cpu.json otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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


def _main_thread(pid: int) -> tuple[float, int]:
    """A process's main thread (its event loop), from /proc (Linux): user + system CPU seconds, and
    how many times it slept (voluntary context switches: waiting for a message or the store)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        slept = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), slept


class Setup:
    """A broker setup and its session pairs: each P on the first address, its D on the last."""

    def __init__(
        self, name: str, brokers: list[BrokerProcess], store: RedisServer | None = None, pairs: int = 1
    ) -> None:
        self.name = name
        self.pairs = pairs
        self.brokers = brokers
        self.store = store  # a store of its own (None: none, or the shared one)
        self.per_cycle_us: list[float] = []
        self.main_us: list[list[float]] = []  # per round: each broker's main thread, us per cycle
        self.sleeps: list[list[float]] = []  # per round: how often each main thread slept, per cycle
        self.sessions: list[tuple[EngineSession, EngineSession]] = []  # (P, D) per pair

    async def open(self) -> None:
        addresses = [b.address for b in self.brokers]
        fast = Backoff(initial_s=0.05, max_s=0.5)
        for i in range(self.pairs):
            suffix = str(i) if self.pairs > 1 else ""
            p = EngineSession(",".join(addresses), engine_info("P" + suffix), ttl_ms=5_000, backoff=fast)
            d = EngineSession(
                ",".join(reversed(addresses)), engine_info("D" + suffix), ttl_ms=5_000, backoff=fast
            )
            self.sessions.append((p, d))
            await p.start(wait_connected_s=10.0)
            await d.start(wait_connected_s=10.0)

    @staticmethod
    async def _pair(p: EngineSession, d: EngineSession, n: int, chains: list[list[int]], first: int) -> None:
        ns = (p.layout_id, "")
        for i in range(first, first + n):
            chain = chains[i % len(chains)][:8]
            held = await p.hold(ns, GPU, chain, list(range(8)), 30_000, reader_engine_id=d.engine.engine_id)
            acquired = await d.acquire(held.lease_id)
            await d.release(held.lease_id, acquired.lease.epoch)

    async def cycles(self, n: int, chains: list[list[int]]) -> float:
        """CPU seconds of the broker processes per cycle over `n` cycles (split over the pairs,
        which run theirs at the same time, each one cycle at a time)."""
        pids = [b.pid for b in self.brokers]
        cpu0 = sum(cpu_seconds(pid) for pid in pids)
        main0 = [_main_thread(pid) for pid in pids]
        share = n // len(self.sessions)
        n = share * len(self.sessions)
        await asyncio.gather(
            *(self._pair(p, d, share, chains, k * share) for k, (p, d) in enumerate(self.sessions))
        )
        main1 = [_main_thread(pid) for pid in pids]
        self.main_us.append([(b[0] - a[0]) / n * 1e6 for a, b in zip(main0, main1, strict=True)])
        self.sleeps.append([(b[1] - a[1]) / n for a, b in zip(main0, main1, strict=True)])
        return (sum(cpu_seconds(pid) for pid in pids) - cpu0) / n

    def main_medians(self, rounds: list[list[float]] | None = None) -> list[float]:
        """Each broker's main-thread CPU per cycle (or `rounds`' figure), median over the rounds."""
        rounds = self.main_us if rounds is None else rounds
        return [statistics.median(r[i] for r in rounds) for i in range(len(self.brokers))]

    async def close(self) -> None:
        for pair in self.sessions:
            for s in pair:
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


def _broker(
    log_dir: Path, name: str, state: str, profile: Path | None, code: Path | None = None
) -> BrokerProcess:
    """`kvbroker serve`; `code`: a checkout whose kvbroker it runs instead of this tree's."""
    extra = ["--metrics-port", "0", "--log-level", "WARNING"]
    if state:
        extra += ["--state", state]
    command: tuple[str, ...] = SERVE
    if profile is not None:
        command = ("-c", _PROFILED.format(out=str(profile / f"{name}.prof")), *SERVE[1:])
    env = None
    if code is not None:  # `-m` and `-c` put the working folder first on the path: run from there
        env = {**os.environ, "PYTHONPATH": str(code)}
    broker = BrokerProcess(
        log_dir, extra, command=command, log_name=f"{name}.log", log_level=None, priority=None, env=env
    )
    broker.cwd = code
    return broker


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
        pairs = args.pairs
        memory = Setup("in-memory", [_broker(log_dir, "memory", "", profile)], pairs=pairs)
        replicas = Setup(
            "redis, 2 replicas",
            [_broker(log_dir, f"replica-{i}", store.url, profile) for i in range(2)],
            pairs=pairs,
        )
        setups = [memory, replicas]
        # Each further setup has a store of its own: the sessions' engine ids are the same.
        if args.before:
            before = RedisServer(log_dir / "redis-before")
            code = Path(args.before).resolve()
            brokers = [_broker(log_dir, f"before-{i}", before.url, None, code) for i in range(2)]
            setups.append(Setup("redis, 2 replicas (before)", brokers, before, pairs))
        if args.one_replica:
            alone = RedisServer(log_dir / "redis-one")
            setups.append(Setup("redis, 1 replica", [_broker(log_dir, "one", alone.url, None)], alone, pairs))
        try:
            for s in setups:
                if s.store is not None:
                    s.store.start()
                for b in s.brokers:
                    b.start()
                await s.open()
                await s.cycles(args.warmup, chains)
            for s in setups:
                s.main_us.clear()  # the warm-up's
                s.sleeps.clear()
            loads = []
            for r in range(args.rounds):
                # Taking turns: each round starts with the next setup, so none always runs first.
                for s in setups[r % len(setups) :] + setups[: r % len(setups)]:
                    s.per_cycle_us.append(await s.cycles(args.cycles, chains) * 1e6)
                loads.append(load_note())
                log(f"round {r + 1}: " + ", ".join(f"{s.name} {s.per_cycle_us[-1]:,.0f} us" for s in setups))
        finally:
            for s in setups:
                await s.close()
                for b in s.brokers:
                    b.stop()
                if s.store is not None:
                    s.store.stop()
            store.stop()
    base = statistics.median(memory.per_cycle_us)
    two = statistics.median(replicas.per_cycle_us)
    ratio = two / base if base else float("nan")  # a run too short for one clock tick
    load = load_note()
    concurrency = f", {pairs} P/D pairs at once" if pairs > 1 else ", one cycle at a time"
    print(
        f"broker CPU per lease cycle (median of {args.rounds} rounds of {args.cycles:,}{concurrency}): in-memory "
        f"{base:,.0f} us, redis 2 replicas {two:,.0f} us (both replicas summed): {ratio:.2f}x "
        f"(load average: {load})"
    )
    for s in setups[2:]:
        median = statistics.median(s.per_cycle_us)
        print(f"  {s.name}: {median:,.0f} us ({median / base:.2f}x)")
    print(
        "  main threads (event loops), us per cycle: "
        + "; ".join(f"{s.name} " + " + ".join(f"{m:,.0f}" for m in s.main_medians()) for s in setups)
    )
    print(
        "  times each main thread slept, per cycle: "
        + "; ".join(f"{s.name} " + " + ".join(f"{m:.1f}" for m in s.main_medians(s.sleeps)) for s in setups)
    )
    if profile is not None:
        _top(profile / "replica-0.prof", args.top)
        return 0
    result: dict[str, Any] = {
        "load": load,
        "loads_per_round": loads,
        # Folders by name only: a recorded result names no machine's paths.
        "settings": {
            k: Path(v).name if k in ("before", "out_dir") and v else v for k, v in vars(args).items()
        },
        "in_memory_us_per_cycle": memory.per_cycle_us,
        "two_replicas_us_per_cycle": replicas.per_cycle_us,
        "in_memory_median_us": base,
        "two_replicas_median_us": two,
        "ratio": ratio,
        "main_thread_us_per_cycle": {s.name: s.main_medians() for s in setups},
        "main_thread_sleeps_per_cycle": {s.name: s.main_medians(s.sleeps) for s in setups},
        "others": {
            s.name: {"us_per_cycle": s.per_cycle_us, "ratio": statistics.median(s.per_cycle_us) / base}
            for s in setups[2:]
        },
    }
    log(f"wrote {write_json(args.name, result, Path(args.out_dir) if args.out_dir else None)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=1_000, help="lease cycles per round and setup")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, setups taking turns")
    ap.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="P/D session pairs cycling at the same time (1: one cycle at a time, every store answer and "
        "notice a wake-up of its own: the worst case for the replicas)",
    )
    ap.add_argument("--warmup", type=int, default=200, help="cycles before measuring, per setup")
    ap.add_argument(
        "--profile", default="", help="a folder: cProfile the brokers, print the holder's replica's"
    )
    ap.add_argument("--top", type=int, default=30, help="functions printed from the profile")
    ap.add_argument(
        "--before",
        default="",
        help="a checkout of older code (a git worktree): its two replicas take turns with this tree's",
    )
    ap.add_argument(
        "--one-replica", action="store_true", help="also both sessions on one replica (no lease crosses)"
    )
    ap.add_argument("--name", default="lease_cpu", help="bench/results/NAME.json")
    ap.add_argument("--out-dir", default="", help="write NAME.json here instead of bench/results")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
