"""What a thread pays in CPU to sleep and be woken by another process: the cost that sets
`bench.scale.lease_cpu`'s figure (docs/scale.md, "Benchmark and capacity").

A replica's event loop sleeps while a store script runs (three per lease cycle) and is woken for the
lease-end notice; the in-memory broker does neither. This program measures what one such sleep and
wake-up costs the thread itself, on this machine:

- a byte sent to a child process over a pipe and echoed back (N round trips), with both processes
  on one core (a wake-up is a switch on that core), on two cores with both sleeping between
  messages, on two cores with the child spinning (only this side sleeps), and on two cores with
  both spinning (nobody sleeps: the floor);
- a small script's round trip to a private redis-server over the replica's own store path
  (`RedisState.run`, as a lease call makes it), back to back and with the thread asleep 1 ms
  between calls (as between the lease calls of a cycle).

Each row is this side's CPU time (`thread_time`) and wall time per round trip, medians of ROUNDS;
the load average is printed beside them. Linux (CPU affinity); the two-core rows need two CPUs.

    python -m bench.scale.wake_cost                  # writes bench/results/wake_cost.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.output import load_note, log, write_json
from testkit.redis_server import RedisServer, missing_reason


def _echo(r: int, w: int, cpu: int, spin: bool) -> None:
    """The child: echo each byte, pinned to `cpu`, spinning on a non-blocking pipe or sleeping."""
    os.sched_setaffinity(0, {cpu})
    if spin:
        os.set_blocking(r, False)
    while True:
        try:
            b = os.read(r, 1)
        except BlockingIOError:
            continue
        if not b:
            os._exit(0)
        os.write(w, b)


def _pipe_rounds(
    mine: int, theirs: int, child_spins: bool, i_spin: bool, n: int, rounds: int
) -> dict[str, float]:
    """Per round trip, this side's CPU and wall microseconds (medians of `rounds`)."""
    to_child, from_parent = os.pipe()[::-1]  # (write end, read end) for parent -> child
    from_child, to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(to_child)
        os.close(from_child)
        _echo(from_parent, to_parent, theirs, child_spins)
    os.close(from_parent)
    os.close(to_parent)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {mine})
    if i_spin:
        os.set_blocking(from_child, False)
    cpu, wall = [], []
    try:
        for _ in range(rounds):
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(n):
                os.write(to_child, b"x")
                while True:
                    try:
                        os.read(from_child, 1)
                        break
                    except BlockingIOError:
                        pass
            cpu.append((time.thread_time() - c0) / n * 1e6)
            wall.append((time.perf_counter() - t0) / n * 1e6)
    finally:
        os.close(to_child)
        os.waitpid(pid, 0)
        os.close(from_child)
        os.sched_setaffinity(0, before)
    return {"cpu_us": statistics.median(cpu), "wall_us": statistics.median(wall)}


def _store_rounds(url: str, gap_s: float, n: int, rounds: int) -> dict[str, float]:
    from kvbroker.broker.fleet.conn import RedisState

    state = RedisState(url)
    script = state.script("return redis.call('HSET', KEYS[1], 'a', ARGV[1])")
    call: Callable[[int], Any] = lambda i: state.run(script, ["wake-cost"], [i])  # noqa: E731
    for i in range(200):
        call(i)
    cpu, wall = [], []
    try:
        for _ in range(rounds):
            c_sum = t_sum = 0.0
            for i in range(n):
                if gap_s:
                    time.sleep(gap_s)
                c0, t0 = time.thread_time(), time.perf_counter()
                call(i)
                c_sum += time.thread_time() - c0
                t_sum += time.perf_counter() - t0
            cpu.append(c_sum / n * 1e6)
            wall.append(t_sum / n * 1e6)
    finally:
        state.close()
    return {"cpu_us": statistics.median(cpu), "wall_us": statistics.median(wall)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trips", type=int, default=3_000, help="round trips per round and row")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="wake_cost", help="bench/results/NAME.json")
    ap.add_argument("--out-dir", default="", help="write NAME.json here instead of bench/results")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    rows: dict[str, dict[str, float]] = {}
    n, r = args.trips, args.rounds
    rows["pipe, one core, both sleep"] = _pipe_rounds(cpus[0], cpus[0], False, False, n, r)
    if len(cpus) > 1:
        a, b = cpus[0], cpus[1]
        rows["pipe, two cores, both sleep"] = _pipe_rounds(a, b, False, False, n, r)
        rows["pipe, two cores, only this side sleeps"] = _pipe_rounds(a, b, True, False, n, r)
        rows["pipe, two cores, nobody sleeps"] = _pipe_rounds(a, b, True, True, n, r)
    reason = missing_reason()
    if reason:
        log(f"no redis-server ({reason}): the store rows are left out")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            store = RedisServer(Path(tmp) / "redis")
            store.start()
            try:
                rows["store script, back to back"] = _store_rounds(store.url, 0.0, n, r)
                rows["store script, 1 ms asleep before each"] = _store_rounds(store.url, 0.001, n, r)
            finally:
                store.stop()
    load = load_note()
    print(f"CPU of this side per round trip (median of {r} rounds of {n:,}; load average: {load}):")
    for name, row in rows.items():
        print(f"  {name:42s} {row['cpu_us']:7.1f} us CPU  {row['wall_us']:8.1f} us wall")
    result = {"load": load, "settings": vars(args), "cpus": len(cpus), "rows": rows}
    log(f"wrote {write_json(args.name, result, Path(args.out_dir) if args.out_dir else None)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
