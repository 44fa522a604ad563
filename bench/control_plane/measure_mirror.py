"""The engine-local index mirror against a broker: time to sync, lookups in process,
and how long a change takes to become visible in it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc

from bench.control_plane.chains import CHAIN_LEN, make_chains
from bench.control_plane.driver import RawSession, bench_engine, make_channels
from bench.control_plane.measure import Settings
from bench.harness.loops import aggregate, closed_loop_threads
from bench.harness.output import log
from kvbroker.clients.mirror import IndexMirror, follow
from kvbroker.v1 import broker_pb2 as pb
from testkit.processes import BrokerProcess


async def start_mirror(
    address: str, layout_id: str, out: dict[str, Any]
) -> tuple[IndexMirror, asyncio.Task[None], grpc.aio.Channel]:
    channel = make_channels(address, 1)[0]
    mirror = IndexMirror(layout_id)
    t0 = time.perf_counter()
    task = asyncio.create_task(follow(mirror, channel))
    while not mirror.synced:
        if task.done():
            raise RuntimeError(f"mirror stream failed: {mirror.stats.errors}")
        await asyncio.sleep(0.01)
    out["mirror_sync"] = {"blocks": mirror.total_blocks(), "seconds": time.perf_counter() - t0}
    log(f"mirror: synced {mirror.total_blocks():,} blocks in {out['mirror_sync']['seconds']:.2f}s")
    return mirror, task, channel


async def measure_mirror(
    s: Settings,
    proc: BrokerProcess,
    out: dict[str, Any],
    mirror: IndexMirror,
    reqs: list[tuple[pb.Namespace, list[int]]],
    sessions: list[RawSession],
    ns: Callable[[str], pb.Namespace],
) -> None:
    """Lookups on the mirror (as the adapter makes them: asker given, pb matches built),
    from 1 and 16 threads, and how long a change takes to become visible in it."""
    asker = bench_engine(sessions[-1].engine_id)
    for n, h in reqs[:8]:
        got = mirror.resolve(n.tenant, h, asker=asker)
        if not got or got[0].matched_blocks != CHAIN_LEN:
            raise RuntimeError(f"mirror resolve is wrong: {got}")

    def op(i: int) -> None:
        n, h = reqs[i % len(reqs)]
        mirror.resolve(n.tenant, h, asker=asker)

    out["resolve_mirror"] = {}
    for c in s.concurrency:
        runs = [
            await asyncio.to_thread(closed_loop_threads, [op] * c, s.ops_for(c), s.warmup, proc.proc.pid)
            for _ in range(s.reps)
        ]
        out["resolve_mirror"][f"c{c}"] = aggregate(runs, in_process=True)
        fig = out["resolve_mirror"][f"c{c}"]
        log(
            f"broker resolve on the engine-local mirror c{c}: p50 {fig['p50_us']['median']:.1f} us, "
            f"{fig['ops_per_s']['median']:,.0f} ops/s"
        )

    # Lag: an engine announces a fresh chain; how long until the mirror names it.
    applied = asyncio.Event()
    plain_apply = mirror.apply

    def apply_and_signal(update: pb.MirrorUpdate) -> None:
        plain_apply(update)
        applied.set()

    mirror.apply = apply_and_signal  # type: ignore[method-assign]
    publisher = sessions[0]
    lags: list[float] = []
    try:
        for k, chain in enumerate(make_chains(s.mirror_lag_samples, seed=4242)):
            tenant = f"lag{k % 4}"
            t0 = time.perf_counter()
            await publisher.announce(ns(tenant), chain)
            while not mirror.resolve(tenant, chain[:1]):
                applied.clear()
                await asyncio.wait_for(applied.wait(), 10)
            lags.append(time.perf_counter() - t0)
    finally:
        mirror.apply = plain_apply  # type: ignore[method-assign]
    lags.sort()
    out["mirror_lag"] = {
        "samples": len(lags),
        "p50_us": lags[len(lags) // 2] * 1e6,
        "p99_us": lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1e6,
        "max_us": lags[-1] * 1e6,
        "how": "announce on one engine's session -> visible in another process's mirror",
    }
    log(
        f"mirror lag (announce -> visible): p50 {out['mirror_lag']['p50_us']:.0f} us, "
        f"p99 {out['mirror_lag']['p99_us']:.0f} us"
    )
