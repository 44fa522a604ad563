"""Our broker as a real process under the workload of bench.control_plane.measure: sessions of many
engines, resolve over session streams and unary calls, inventory rates (bench.control_plane.measure_inventory),
the engine-local mirror (bench.control_plane.measure_mirror), and memory per indexed block."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from bench.control_plane.chains import CHAIN_LEN, make_chains
from bench.control_plane.driver import RawSession, async_stub, make_channels, open_sessions, start_broker
from bench.control_plane.measure import Settings, lookup_namespaces, run_async
from bench.control_plane.measure_inventory import measure_inventory, measure_inventory_engine_sessions
from bench.control_plane.measure_mirror import measure_mirror, start_mirror
from bench.harness.loops import RunResult, aggregate, closed_loop_async, rss_bytes
from bench.harness.output import log
from kvbroker.clients.engine_session import EngineSession
from kvbroker.clients.mirror import IndexMirror, follow
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc
from testkit.processes import BrokerProcess
from testkit.waiting import until


async def _stats(stub: broker_pb2_grpc.KVBrokerAsyncStub) -> pb.StatsResponse:
    return await stub.Stats(pb.StatsRequest())


def measure_broker(s: Settings, log_dir: Path, with_memory: bool = True) -> dict[str, Any]:
    """Our broker as a real process: resolve (session and unary), inventory rate, memory per block."""
    proc = start_broker(log_dir, s.broker_args)
    log(f"broker: pid {proc.pid} listening on {proc.address}")  # e.g. for py-spy record -p PID
    try:
        return run_async(lambda: _measure_broker(s, proc, with_memory))
    finally:
        proc.close()


async def _measure_broker(s: Settings, proc: BrokerProcess, with_memory: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"available": True, "address": proc.address}
    channels = make_channels(proc.address, s.session_channels)
    stubs = [async_stub(ch) for ch in channels]
    rss_start = rss_bytes(proc.pid)
    t = time.perf_counter()
    engine_ids = [f"bench-e{i:04d}" for i in range(s.engines)]
    sessions = await open_sessions(stubs, engine_ids)
    out["engines"] = {
        "registered": len(sessions),
        "how": f"{len(sessions)} real session streams (one per engine) over {len(channels)} channels",
        "register_s": time.perf_counter() - t,
        "rss_after_register_bytes": rss_bytes(proc.pid),
        "rss_start_bytes": rss_start,
    }
    layout_id = sessions[0].layout_id
    publishers: list[EngineSession] = []
    log(
        f"broker: {len(sessions)} engines registered in {out['engines']['register_s']:.1f}s (layout {layout_id})"
    )

    def ns(tenant: str) -> pb.Namespace:
        return pb.Namespace(layout_id=layout_id, tenant=tenant)

    try:
        loader = _Loader(s, stubs[0], sessions, ns)
        mem: dict[str, Any] = {"points": []}
        rss_base = rss_bytes(proc.pid)
        # 1) A first memory point (also makes resolve run on a realistically sized index).
        if with_memory and s.broker_mem_blocks:
            rate = await loader.load_to(s.broker_mem_blocks[0])
            mem["points"].append(await _memory_point(proc, stubs[0], rss_base, rate))
            log(_mem_line(mem["points"][-1]))
        reqs = await _hold_lookup_chains(s, sessions, ns)
        # 3) Resolve latency over session streams and unary.
        out["resolve_session"], out["resolve_unary"] = {}, {}
        for c in s.concurrency:
            await _measure_resolve(s, proc, sessions[-c:], reqs, c, out)
        # 3b) The engine-local index mirror: sync, lookups in process, change-to-visible lag.
        mirror, mirror_task, mirror_channel = await start_mirror(proc.address, layout_id, out)
        try:
            await measure_mirror(s, proc, out, mirror, reqs, sessions, ns)
        finally:
            mirror_task.cancel()
            await asyncio.gather(mirror_task, return_exceptions=True)
        await _measure_inventories(s, proc, sessions, ns, layout_id, mirror_channel, publishers, out)
        # 5) The remaining memory points.
        if with_memory:
            for target in s.broker_mem_blocks[1:]:
                rate = await loader.load_to(target)
                mem["points"].append(await _memory_point(proc, stubs[0], rss_base, rate))
                log(_mem_line(mem["points"][-1]))
            mem["rss_baseline_bytes"] = rss_base
            mem["load_batch_blocks"] = s.broker_load_batch
            out["memory"] = mem
        out["rss_end_bytes"] = rss_bytes(proc.pid)
        return out
    finally:
        for sess in sessions:
            with contextlib.suppress(Exception):
                await sess.close()
        for publisher in publishers:
            with contextlib.suppress(Exception):
                await publisher.close()
        for ch in channels:
            await ch.close()


class _Loader:
    """Announces random blocks from every session in big batches (the memory points' load)."""

    def __init__(
        self,
        s: Settings,
        stub: broker_pb2_grpc.KVBrokerAsyncStub,
        sessions: list[RawSession],
        ns: Callable[[str], pb.Namespace],
    ) -> None:
        self.s, self.stub, self.sessions, self.ns = s, stub, sessions, ns
        self.rng = random.Random(5)

    async def load_to(self, target: int) -> float:
        """Announce until ``target`` blocks are indexed; returns blocks per second."""
        loaded = int((await _stats(self.stub)).blocks_indexed)
        todo = target - loaded
        per = max(1, todo // len(self.sessions))
        t0 = time.perf_counter()
        sem = asyncio.Semaphore(64)

        async def one(i: int, sess: RawSession) -> int:
            n = per if i < len(self.sessions) - 1 else todo - per * (len(self.sessions) - 1)
            done = 0
            tenant = self.ns(f"m{i % 16}")
            async with sem:
                while done < n:
                    b = min(self.s.broker_load_batch, n - done)
                    await sess.announce(tenant, [self.rng.getrandbits(64) for _ in range(b)])
                    done += b
                await sess.barrier(tenant)
            return done

        counts = await asyncio.gather(*(one(i, x) for i, x in enumerate(self.sessions)))
        return sum(counts) / (time.perf_counter() - t0)


async def _hold_lookup_chains(
    s: Settings, sessions: list[RawSession], ns: Callable[[str], pb.Namespace]
) -> list[tuple[pb.Namespace, list[int]]]:
    """2) Lookup chains, each held by one engine. The broker never names the asking engine as a
    holder, so the last engines (the resolving clients) hold none of them. Checked once."""
    chains = make_chains(s.lookup_chains, seed=7)
    nss = lookup_namespaces(len(chains))
    holders = sessions[: max(1, len(sessions) - max(s.concurrency))]
    for i, (tenant, chain) in enumerate(zip(nss, chains, strict=True)):
        await holders[i % len(holders)].announce(ns(tenant), chain)
    for sess in holders[: len(chains)]:
        await sess.barrier(ns("t0"))
    reqs = [(ns(tenant), chain) for tenant, chain in zip(nss, chains, strict=True)]
    check = await sessions[-1].resolve(*reqs[0])
    if not check.matches or check.matches[0].matched_blocks != CHAIN_LEN:
        raise RuntimeError(f"broker resolve is wrong: {check}")
    return reqs


async def _measure_resolve(
    s: Settings,
    proc: BrokerProcess,
    readers: list[RawSession],
    reqs: list[tuple[pb.Namespace, list[int]]],
    c: int,
    out: dict[str, Any],
) -> None:
    """Resolve at `c` clients: over the readers' session streams, then unary on `c` channels."""

    def sess_op(sess: RawSession) -> Callable[[int], Awaitable[Any]]:
        async def op(i: int) -> None:
            n, h = reqs[i % len(reqs)]
            await sess.resolve(n, h)

        return op

    runs: list[RunResult] = []
    for _ in range(s.reps):
        runs.append(await closed_loop_async([sess_op(x) for x in readers], s.ops_for(c), s.warmup, proc.pid))
    out["resolve_session"][f"c{c}"] = aggregate(runs)
    log(f"broker resolve over session c{c}: p50 {out['resolve_session'][f'c{c}']['p50_us']['median']:.0f} us")

    unary_channels = make_channels(proc.address, c)
    ustubs = [async_stub(ch) for ch in unary_channels]

    def unary_op(stub: broker_pb2_grpc.KVBrokerAsyncStub) -> Callable[[int], Awaitable[Any]]:
        async def op(i: int) -> None:
            n, h = reqs[i % len(reqs)]
            await stub.Resolve(pb.ResolveRequest(namespace=n, block_hashes=h))

        return op

    runs = []
    for _ in range(s.reps):
        runs.append(await closed_loop_async([unary_op(x) for x in ustubs], s.ops_for(c), s.warmup, proc.pid))
    out["resolve_unary"][f"c{c}"] = aggregate(runs)
    log(f"broker unary Resolve c{c}: p50 {out['resolve_unary'][f'c{c}']['p50_us']['median']:.0f} us")
    for ch in unary_channels:
        await ch.close()


async def _measure_inventories(
    s: Settings,
    proc: BrokerProcess,
    sessions: list[RawSession],
    ns: Callable[[str], pb.Namespace],
    layout_id: str,
    mirror_channel: grpc.aio.Channel,
    publishers: list[EngineSession],
    out: dict[str, Any],
) -> None:
    """4) Inventory rate: each session pipelines InventoryUpdates of 64 blocks, then a barrier;
    once with no mirror attached, once with one following every change. 4b) The same chains
    announced the way an engine does (EngineSession.announce_stored); those sessions go into
    `publishers` and stay open to the end: closing them would drop their blocks and leave that
    garbage in the memory figures."""
    out["inventory"] = await measure_inventory(s, proc, sessions, ns, mirror_task=None)
    mirror2 = IndexMirror(layout_id)
    follower = asyncio.create_task(follow(mirror2, mirror_channel))
    try:
        await until(lambda: mirror2.synced, timeout=120, message="the second mirror did not sync")
        out["inventory_with_mirror"] = await measure_inventory(s, proc, sessions, ns, mirror_task=follower)
        out["inventory_with_mirror"]["mirror_resets"] = mirror2.stats.resets
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await mirror_channel.close()
    out["inventory_engine_session"] = await measure_inventory_engine_sessions(s, proc, layout_id, publishers)


async def _memory_point(
    proc: BrokerProcess, stub: broker_pb2_grpc.KVBrokerAsyncStub, rss_base: int, load_rate: float
) -> dict[str, Any]:
    gc.collect()  # our side only; the broker's RSS is what it is
    await asyncio.sleep(0.5)
    st = await _stats(stub)
    rss = rss_bytes(proc.pid)
    blocks = int(st.blocks_indexed)
    return {
        "blocks_indexed": blocks,
        "rss_bytes": rss,
        "rss_delta_bytes": rss - rss_base,
        "bytes_per_block": (rss - rss_base) / blocks if blocks else float("nan"),
        "load_blocks_per_s": load_rate,
    }


def _mem_line(p: dict[str, Any]) -> str:
    return (
        f"broker memory: {p['bytes_per_block']:.0f} B/block at {p['blocks_indexed']:,} blocks "
        f"(RSS +{p['rss_delta_bytes'] / 2**20:.0f} MiB; loaded at {p['load_blocks_per_s']:,.0f} blocks/s)"
    )
