"""The fixed control-plane workloads, one function per system; each returns a JSON-ready dict.

Workload: namespaces of 64-block chains of random 64-bit hashes. A lookup asks for
the longest held prefix of one chain (every lookup chain is fully held, and each
answer is checked to be 64 before timing starts). Publishing announces a fresh
chain of 64 blocks. Latency is closed-loop (see bench.common) at 1 and 16
concurrent clients, repeated ``reps`` times.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from bench.broker_driver import BrokerProcess, RawSession, bench_engine, make_channels, open_sessions
from bench.common import (
    CHAIN_LEN,
    AsyncOp,
    RunResult,
    SyncOp,
    aggregate,
    closed_loop_async,
    closed_loop_threads,
    cpu_seconds,
    log,
    make_chains,
)
from bench.grpc_echo import STREAM_METHOD, UNARY_METHOD
from bench.peers import GrpcEchoPeer, MooncakePeer, PeerUnavailable, RedisPeer, chain_keys
from kvbroker.clients.mirror import IndexMirror, follow
from kvbroker.clients.session import EngineSession
from kvbroker.v1 import broker_pb2 as pb
from kvbroker.v1 import broker_pb2_grpc

T = TypeVar("T")


@dataclass
class Settings:
    """Sizes of one benchmark run; ``quick()`` and ``tiny()`` shrink them."""

    reps: int = 5
    warmup: int = 50
    ops_1: int = 2000  # measured ops of the single client, per repetition
    ops_16: int = 300  # measured ops per client with 16 clients, per repetition
    concurrency: tuple[int, ...] = (1, 16)
    lookup_chains: int = 256
    publish_ops_1: int = 300  # chains published by the single client, per repetition
    publish_ops_16: int = 60  # chains published per client with 16 clients
    engines: int = 1000
    session_channels: int = 8
    broker_mem_blocks: tuple[int, ...] = (1_000_000, 10_000_000)
    broker_load_batch: int = 8192
    redis_mem_keys: int = 1_000_000
    mooncake_mem_keys: int = 100_000
    mirror_lag_samples: int = 300
    ttl_ms: int = 600_000
    broker_args: list[str] = field(default_factory=list)

    @classmethod
    def quick(cls) -> Settings:
        return cls(
            reps=3,
            warmup=30,
            ops_1=600,
            ops_16=80,
            publish_ops_1=100,
            publish_ops_16=20,
            engines=1000,
            broker_mem_blocks=(200_000, 1_000_000),
            redis_mem_keys=100_000,
            mooncake_mem_keys=10_000,
        )

    @classmethod
    def tiny(cls) -> Settings:
        """Smoke-test sizes: proves the programs work, measures nothing worth keeping."""
        return cls(
            reps=1,
            warmup=3,
            ops_1=30,
            ops_16=5,
            concurrency=(1, 4),
            lookup_chains=16,
            publish_ops_1=5,
            publish_ops_16=2,
            engines=20,
            session_channels=2,
            broker_mem_blocks=(5_000, 20_000),
            broker_load_batch=2048,
            redis_mem_keys=2_000,
            mooncake_mem_keys=500,
        )

    def ops_for(self, clients: int) -> int:
        return self.ops_1 if clients == 1 else self.ops_16

    def publish_ops_for(self, clients: int) -> int:
        return self.publish_ops_1 if clients == 1 else self.publish_ops_16


def run_async(coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run on uvloop when installed (the broker runs on it), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro_fn())
    return uvloop.run(coro_fn())


def lookup_namespaces(n_chains: int) -> list[str]:
    return [f"t{i % 4}" for i in range(n_chains)]


# --------------------------------------------------------------------------- grpc floors


def measure_grpc_floors(s: Settings, log_dir: Path) -> dict[str, Any]:
    chains = make_chains(s.lookup_chains, seed=11)
    peer = GrpcEchoPeer(log_dir)
    try:

        async def main() -> dict[str, Any]:
            out: dict[str, Any] = {"unary": {}, "stream": {}}
            for c in s.concurrency:
                channels = [grpc.aio.insecure_channel(peer.address) for _ in range(c)]
                unary = [
                    ch.unary_unary(
                        UNARY_METHOD,
                        request_serializer=pb.ResolveRequest.SerializeToString,
                        response_deserializer=pb.ResolveRequest.FromString,
                    )
                    for ch in channels
                ]

                def unary_op(call: Any) -> Callable[[int], Awaitable[Any]]:
                    async def op(i: int) -> None:
                        await call(pb.ResolveRequest(block_hashes=chains[i % len(chains)]))

                    return op

                runs = [
                    await closed_loop_async(
                        [unary_op(u) for u in unary], s.ops_for(c), s.warmup, peer.proc.pid
                    )
                    for _ in range(s.reps)
                ]
                out["unary"][f"c{c}"] = aggregate(runs)
                log(f"grpc unary echo c{c}: p50 {out['unary'][f'c{c}']['p50_us']['median']:.0f} us")

                streams = [
                    ch.stream_stream(
                        STREAM_METHOD,
                        request_serializer=pb.ResolveRequest.SerializeToString,
                        response_deserializer=pb.ResolveRequest.FromString,
                    )()
                    for ch in channels
                ]

                def stream_op(call: Any) -> Callable[[int], Awaitable[Any]]:
                    async def op(i: int) -> None:
                        await call.write(pb.ResolveRequest(block_hashes=chains[i % len(chains)]))
                        await call.read()

                    return op

                runs = [
                    await closed_loop_async(
                        [stream_op(st) for st in streams], s.ops_for(c), s.warmup, peer.proc.pid
                    )
                    for _ in range(s.reps)
                ]
                out["stream"][f"c{c}"] = aggregate(runs)
                log(f"grpc bidi ping-pong c{c}: p50 {out['stream'][f'c{c}']['p50_us']['median']:.0f} us")
                for st in streams:
                    st.cancel()
                for ch in channels:
                    await ch.close()
            return out

        result = run_async(main)
        return {"available": True, "grpc_version": grpc.__version__, **result}
    finally:
        peer.close()


# --------------------------------------------------------------------------- Redis


def measure_redis(
    s: Settings, log_dir: Path, with_lua: bool = True, with_memory: bool = True
) -> dict[str, Any]:
    """Redis with both usual Python clients: blocking redis-py in threads, and redis.asyncio.

    Each figure is measured with both; the table shows the better one (higher
    throughput) so the peer gets its best showing, and the JSON keeps both.
    """
    try:
        peer = RedisPeer(log_dir)
    except PeerUnavailable as e:
        log(f"Redis skipped: {e}")
        return {"available": False, "reason": str(e)}
    try:
        out: dict[str, Any] = {"available": True, "version": peer.version, "hiredis": peer.hiredis}
        chains = make_chains(s.lookup_chains, seed=7)
        nss = lookup_namespaces(len(chains))
        keys = [chain_keys(ns, c) for ns, c in zip(nss, chains, strict=True)]
        r0 = peer.client()
        for k in keys:
            peer.publish_chain(r0, k, b"e0001", s.ttl_ms)
        assert all(peer.mget_prefix(r0, k) == CHAIN_LEN for k in keys[:8]), "Redis MGET lookup is wrong"
        assert all(peer.lua_prefix(r0, k) == CHAIN_LEN for k in keys[:8]), "Redis Lua lookup is wrong"
        kinds = ["mget", *(["lua"] if with_lua else []), "publish"]
        for kind in kinds:
            out[kind] = {}
            out[f"{kind}_by_client"] = {}
            for c in s.concurrency:
                by_client = {
                    "threads": aggregate(_redis_runs_threads(peer, kind, c, s, keys)),
                    "asyncio": aggregate(
                        run_async(functools.partial(_redis_runs_async, peer, kind, c, s, keys))
                    ),
                }
                if kind == "publish":
                    by_client = {k: _with_blocks_per_s(v) for k, v in by_client.items()}
                best = max(by_client, key=lambda k: float(by_client[k]["ops_per_s"]["median"]))
                out[kind][f"c{c}"] = {**by_client[best], "client": best}
                out[f"{kind}_by_client"][f"c{c}"] = by_client
                fig = out[kind][f"c{c}"]
                what = (
                    f"{fig['blocks_per_s']['median']:,.0f} blocks/s"
                    if kind == "publish"
                    else f"p50 {fig['p50_us']['median']:.0f} us, {fig['ops_per_s']['median']:,.0f} ops/s"
                )
                log(f"Redis {kind} c{c}: {what} (best client: {best})")
        if with_memory:
            peer.flush()
            time.sleep(0.2)
            used0, rss0 = peer.used_memory(), peer.rss()
            rng = random.Random(99)
            n = peer.bulk_load(
                (f"t{i % 4}:{rng.getrandbits(64):016x}" for i in range(s.redis_mem_keys)), b"e0001", s.ttl_ms
            )
            used1, rss1 = peer.used_memory(), peer.rss()
            out["memory"] = {
                "keys": n,
                "used_memory_bytes_per_key": (used1 - used0) / n,
                "rss_bytes_per_key": (rss1 - rss0) / n,
                "key_format": "'t<n>:<16 hex digits>' -> 'e0001' with PX",
            }
            log(f"Redis memory: {(used1 - used0) / n:.0f} B/key (used_memory) at {n:,} keys")
        return out
    finally:
        peer.close()


def _publish_chains(s: Settings, c: int, rep: int) -> list[list[str]]:
    n = c * (s.warmup + s.publish_ops_for(c))
    return [chain_keys("pub", ch) for ch in make_chains(n, seed=1000 + rep * 100 + c)]


def _redis_sync_op(peer: RedisPeer, kind: str, r: Any, chains: list[list[str]], ttl_ms: int) -> SyncOp:
    if kind == "publish":
        return lambda i: peer.publish_chain(r, chains[i % len(chains)], b"e0001", ttl_ms)
    if kind == "mget":
        return lambda i: peer.mget_prefix(r, chains[i % len(chains)])
    return lambda i: peer.lua_prefix(r, chains[i % len(chains)])


def _redis_async_op(peer: RedisPeer, kind: str, r: Any, chains: list[list[str]], ttl_ms: int) -> AsyncOp:
    if kind == "publish":
        return lambda i: peer.publish_chain_async(r, chains[i % len(chains)], b"e0001", ttl_ms)
    if kind == "mget":
        return lambda i: peer.mget_prefix_async(r, chains[i % len(chains)])
    return lambda i: peer.lua_prefix_async(r, chains[i % len(chains)])


def _redis_runs_threads(
    peer: RedisPeer, kind: str, c: int, s: Settings, keys: list[list[str]]
) -> list[RunResult]:
    clients = [peer.client() for _ in range(c)]
    runs = []
    try:
        for rep in range(s.reps):
            chains = _publish_chains(s, c, rep) if kind == "publish" else keys
            n = s.publish_ops_for(c) if kind == "publish" else s.ops_for(c)
            ops = [_redis_sync_op(peer, kind, r, chains, s.ttl_ms) for r in clients]
            runs.append(closed_loop_threads(ops, n, s.warmup, peer.proc.pid))
    finally:
        for r in clients:
            r.close()
    return runs


async def _redis_runs_async(
    peer: RedisPeer, kind: str, c: int, s: Settings, keys: list[list[str]]
) -> list[RunResult]:
    clients = [peer.aclient() for _ in range(c)]
    runs = []
    try:
        for rep in range(s.reps):
            chains = _publish_chains(s, c, rep) if kind == "publish" else keys
            n = s.publish_ops_for(c) if kind == "publish" else s.ops_for(c)
            ops = [_redis_async_op(peer, kind, r, chains, s.ttl_ms) for r in clients]
            runs.append(await closed_loop_async(ops, n, s.warmup, peer.proc.pid))
    finally:
        for r in clients:
            await r.aclose()
    return runs


def _with_blocks_per_s(agg: dict[str, Any]) -> dict[str, Any]:
    ops = agg["ops_per_s"]
    agg["blocks_per_s"] = {
        "median": ops["median"] * CHAIN_LEN,
        "min": ops["min"] * CHAIN_LEN,
        "max": ops["max"] * CHAIN_LEN,
        "runs": [x * CHAIN_LEN for x in ops["runs"]],
    }
    return agg


# --------------------------------------------------------------------------- Mooncake


def measure_mooncake(s: Settings, log_dir: Path, with_memory: bool = True) -> dict[str, Any]:
    try:
        peer = MooncakePeer(log_dir)
    except PeerUnavailable as e:
        log(f"Mooncake skipped: {e}")
        return {"available": False, "reason": str(e)}
    try:
        out: dict[str, Any] = {"available": True, "batch_is_exist": {}}
        chains = make_chains(s.lookup_chains, seed=7)
        nss = lookup_namespaces(len(chains))
        keys = [chain_keys(ns, c) for ns, c in zip(nss, chains, strict=True)]
        for k in keys:
            peer.put_keys(k)
        assert all(peer.exist_prefix(k) == CHAIN_LEN for k in keys[:8]), "Mooncake lookup is wrong"
        for c in s.concurrency:
            op = lambda i: peer.exist_prefix(keys[i % len(keys)])  # noqa: E731 - one shared client
            runs = [
                closed_loop_threads([op] * c, s.ops_for(c), s.warmup, peer.proc.pid) for _ in range(s.reps)
            ]
            out["batch_is_exist"][f"c{c}"] = aggregate(runs)
            log(
                f"Mooncake batch_is_exist c{c}: p50 {out['batch_is_exist'][f'c{c}']['p50_us']['median']:.0f} us"
            )
        if with_memory:
            rss0 = peer.rss()
            rng = random.Random(98)
            mem_keys = [f"m{i % 4}:{rng.getrandbits(64):016x}" for i in range(s.mooncake_mem_keys)]
            t = time.perf_counter()
            peer.put_keys(mem_keys)
            took = time.perf_counter() - t
            time.sleep(0.5)
            rss1 = peer.rss()
            out["memory"] = {
                "keys": len(mem_keys),
                "rss_bytes_per_key": (rss1 - rss0) / len(mem_keys),
                "load_keys_per_s": len(mem_keys) / took,
                "value_bytes": 1,
            }
            log(
                f"Mooncake master memory: {(rss1 - rss0) / len(mem_keys):.0f} B/key (RSS) at {len(mem_keys):,} keys"
            )
        return out
    finally:
        peer.close()


# --------------------------------------------------------------------------- our broker


@dataclass
class BrokerFixture:
    proc: BrokerProcess
    channels: list[grpc.aio.Channel]
    stubs: list[broker_pb2_grpc.KVBrokerStub]
    sessions: list[RawSession]


async def _stats(stub: broker_pb2_grpc.KVBrokerStub) -> pb.StatsResponse:
    return await stub.Stats(pb.StatsRequest())


def measure_broker(s: Settings, log_dir: Path, with_memory: bool = True) -> dict[str, Any]:
    """Our broker as a real process: resolve (session and unary), inventory rate, memory per block."""
    proc = BrokerProcess(log_dir, s.broker_args)
    log(f"broker: pid {proc.pid} listening on {proc.address}")  # e.g. for py-spy record -p PID
    try:
        return run_async(lambda: _measure_broker(s, proc, with_memory))
    finally:
        proc.close()


async def _measure_broker(s: Settings, proc: BrokerProcess, with_memory: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"available": True, "address": proc.address}
    channels = make_channels(proc.address, s.session_channels)
    stubs = [broker_pb2_grpc.KVBrokerStub(ch) for ch in channels]
    rss_start = proc.rss()
    t = time.perf_counter()
    engine_ids = [f"bench-e{i:04d}" for i in range(s.engines)]
    sessions = await open_sessions(stubs, engine_ids)
    out["engines"] = {
        "registered": len(sessions),
        "how": f"{len(sessions)} real session streams (one per engine) over {len(channels)} channels",
        "register_s": time.perf_counter() - t,
        "rss_after_register_bytes": proc.rss(),
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
        rng = random.Random(5)
        mem: dict[str, Any] = {"points": []}
        rss_base = proc.rss()
        loaded = 0

        async def load_to(target: int) -> float:
            """Announce random blocks from all sessions in big batches until ``target`` are indexed."""
            nonlocal loaded
            loaded = int((await _stats(stubs[0])).blocks_indexed)
            todo = target - loaded
            per = max(1, todo // len(sessions))
            t0 = time.perf_counter()
            sent = 0

            async def one(i: int, sess: RawSession) -> int:
                n = per if i < len(sessions) - 1 else todo - per * (len(sessions) - 1)
                done = 0
                tenant = ns(f"m{i % 16}")
                while done < n:
                    b = min(s.broker_load_batch, n - done)
                    await sess.announce(tenant, [rng.getrandbits(64) for _ in range(b)])
                    done += b
                await sess.barrier(tenant)
                return done

            sem = asyncio.Semaphore(64)

            async def limited(i: int, sess: RawSession) -> int:
                async with sem:
                    return await one(i, sess)

            counts = await asyncio.gather(*(limited(i, x) for i, x in enumerate(sessions)))
            sent = sum(counts)
            loaded += sent
            return sent / (time.perf_counter() - t0)

        # 1) A first memory point (also makes resolve run on a realistically sized index).
        if with_memory and s.broker_mem_blocks:
            rate = await load_to(s.broker_mem_blocks[0])
            mem["points"].append(await _memory_point(proc, stubs[0], rss_base, rate))
            log(_mem_line(mem["points"][-1]))

        # 2) Lookup chains, each held by one engine. The broker never names the asking engine
        #    as a holder, so the last engines (the resolving clients) hold none of them.
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

        # 3) Resolve latency over session streams and unary.
        out["resolve_session"] = {}
        out["resolve_unary"] = {}
        for c in s.concurrency:
            readers = sessions[-c:]

            def sess_op(sess: RawSession) -> Callable[[int], Awaitable[Any]]:
                async def op(i: int) -> None:
                    n, h = reqs[i % len(reqs)]
                    await sess.resolve(n, h)

                return op

            runs: list[RunResult] = []
            for _ in range(s.reps):
                runs.append(
                    await closed_loop_async(
                        [sess_op(x) for x in readers], s.ops_for(c), s.warmup, proc.proc.pid
                    )
                )
            out["resolve_session"][f"c{c}"] = aggregate(runs)
            log(
                f"broker resolve over session c{c}: p50 {out['resolve_session'][f'c{c}']['p50_us']['median']:.0f} us"
            )

            unary_channels = make_channels(proc.address, c)
            ustubs = [broker_pb2_grpc.KVBrokerStub(ch) for ch in unary_channels]

            def unary_op(stub: broker_pb2_grpc.KVBrokerStub) -> Callable[[int], Awaitable[Any]]:
                async def op(i: int) -> None:
                    n, h = reqs[i % len(reqs)]
                    await stub.Resolve(pb.ResolveRequest(namespace=n, block_hashes=h))

                return op

            runs = []
            for _ in range(s.reps):
                runs.append(
                    await closed_loop_async(
                        [unary_op(x) for x in ustubs], s.ops_for(c), s.warmup, proc.proc.pid
                    )
                )
            out["resolve_unary"][f"c{c}"] = aggregate(runs)
            log(f"broker unary Resolve c{c}: p50 {out['resolve_unary'][f'c{c}']['p50_us']['median']:.0f} us")
            for ch in unary_channels:
                await ch.close()

        # 3b) The engine-local index mirror: sync, lookups in process, change-to-visible lag.
        mirror, mirror_task, mirror_channel = await _start_mirror(proc.address, layout_id, out)
        try:
            await _measure_mirror(s, proc, out, mirror, reqs, sessions, ns)
        finally:
            mirror_task.cancel()
            await asyncio.gather(mirror_task, return_exceptions=True)

        # 4) Inventory rate: each session pipelines InventoryUpdates of 64 blocks, then a barrier.
        #    Once with no mirror attached, once with one following every change.
        out["inventory"] = await _measure_inventory(s, proc, sessions, ns, mirror_task=None)
        mirror2 = IndexMirror(layout_id)
        follower = asyncio.create_task(follow(mirror2, mirror_channel))
        try:
            while not mirror2.synced:
                await asyncio.sleep(0.01)
            out["inventory_with_mirror"] = await _measure_inventory(
                s, proc, sessions, ns, mirror_task=follower
            )
            out["inventory_with_mirror"]["mirror_resets"] = mirror2.stats.resets
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await mirror_channel.close()
        # 4b) The same chains announced the way an engine does: EngineSession.announce_stored.
        #     Their sessions stay open to the end: closing them would drop their blocks and
        #     leave that garbage in the memory figures below.
        out["inventory_engine_session"] = await _measure_inventory_engine_sessions(
            s, proc, layout_id, publishers
        )

        # 5) The remaining memory points.
        if with_memory:
            for target in s.broker_mem_blocks[1:]:
                rate = await load_to(target)
                mem["points"].append(await _memory_point(proc, stubs[0], rss_base, rate))
                log(_mem_line(mem["points"][-1]))
            mem["rss_baseline_bytes"] = rss_base
            mem["load_batch_blocks"] = s.broker_load_batch
            out["memory"] = mem
        out["rss_end_bytes"] = proc.rss()
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


async def _measure_inventory(
    s: Settings,
    proc: BrokerProcess,
    sessions: list[RawSession],
    ns: Callable[[str], pb.Namespace],
    mirror_task: asyncio.Task[None] | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seed_base = 7_000_000 if mirror_task is not None else 0  # fresh chains for each pass
    for c in s.concurrency:
        senders = sessions[:c]
        per_client = s.publish_ops_for(c) * 4  # fire-and-forget is cheap; send more to time it well
        figs, cpu_ns = [], []
        for rep in range(s.reps):
            batches = [
                make_chains(per_client, seed=seed_base + (5 + c) * 100_000 + rep * 1000 + j) for j in range(c)
            ]

            async def push(sess: RawSession, chains_: list[list[int]], j: int) -> None:
                tenant = ns(f"p{j % 4}")
                for ch in chains_:
                    await sess.announce(tenant, ch)
                await sess.barrier(tenant)

            rate, cpu = await _timed_blocks(
                proc,
                c * per_client * CHAIN_LEN,
                asyncio.gather(
                    *(push(x, b, j) for j, (x, b) in enumerate(zip(senders, batches, strict=True)))
                ),
            )
            figs.append(rate)
            cpu_ns.append(cpu)
        out[f"c{c}"] = _inventory_figure(figs, cpu_ns, batch_blocks=CHAIN_LEN, messages_per_client=per_client)
        what = "with a mirror following" if mirror_task is not None else "no mirror"
        log(f"broker inventory c{c} (64-block updates, {what}): {_median(figs):,.0f} blocks/s")
    return out


async def _measure_inventory_engine_sessions(
    s: Settings, proc: BrokerProcess, layout_id: str, opened: list[EngineSession]
) -> dict[str, Any]:
    """Inventory through the client library's EngineSession, the adapter's path: each
    announce_stored() of a 64-block chain returns at once, and the session coalesces
    what piles up (up to flush_max_hashes, or flush_interval_s) into few messages on
    its stream. The clock stops when a resolve sent after the last announce is
    answered (the stream is ordered)."""
    out: dict[str, Any] = {}
    for c in s.concurrency:
        sessions = [
            EngineSession(proc.address, bench_engine(f"bench-pub-{c}-{j}"), ttl_ms=30_000) for j in range(c)
        ]
        opened.extend(sessions)
        for sess in sessions:
            await sess.start(wait_connected_s=30)
        per_client = s.publish_ops_for(c) * 4
        figs, cpu_ns = [], []
        for rep_ in range(s.reps):
            batches = [
                make_chains(per_client, seed=9_000_000 + c * 100_000 + rep_ * 1000 + j) for j in range(c)
            ]

            async def push(sess: EngineSession, chains_: list[list[int]], j: int) -> None:
                ns = (layout_id, f"s{j % 4}")
                for i, ch in enumerate(chains_):
                    sess.announce_stored(ns, pb.TIER_GPU, ch)
                    if i % 16 == 15:
                        await asyncio.sleep(0)  # an engine's scheduler steps between batches
                await sess.resolve(ns, [0])

            rate, cpu = await _timed_blocks(
                proc,
                c * per_client * CHAIN_LEN,
                asyncio.gather(
                    *(push(x, b, j) for j, (x, b) in enumerate(zip(sessions, batches, strict=True)))
                ),
            )
            figs.append(rate)
            cpu_ns.append(cpu)
        out[f"c{c}"] = _inventory_figure(
            figs,
            cpu_ns,
            batch_blocks=CHAIN_LEN,
            announces_per_client=per_client,
            coalesced_up_to_hashes=sessions[0].flush_max_hashes,
        )
        log(
            f"broker inventory c{c} (EngineSession.announce_stored of 64, coalesced): {_median(figs):,.0f} blocks/s"
        )
    return out


async def _timed_blocks(proc: BrokerProcess, blocks: int, work: Awaitable[Any]) -> tuple[float, float]:
    """Run `work` (which publishes `blocks` blocks); return blocks/s and broker CPU ns per block."""
    cpu0 = cpu_seconds(proc.proc.pid)
    t0 = time.perf_counter()
    await work
    elapsed = time.perf_counter() - t0
    return blocks / elapsed, (cpu_seconds(proc.proc.pid) - cpu0) / blocks * 1e9


def _inventory_figure(figs: list[float], cpu_ns: list[float], **extra: Any) -> dict[str, Any]:
    def spread(xs: list[float]) -> dict[str, Any]:
        return {"median": _median(xs), "min": min(xs), "max": max(xs), "runs": xs}

    return {"blocks_per_s": spread(figs), "server_cpu_ns_per_block": spread(cpu_ns), **extra}


async def _start_mirror(
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


async def _measure_mirror(
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
        out["resolve_mirror"][f"c{c}"] = aggregate(runs)
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


def _median(xs: Sequence[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2


async def _memory_point(
    proc: BrokerProcess, stub: broker_pb2_grpc.KVBrokerStub, rss_base: int, load_rate: float
) -> dict[str, Any]:
    gc.collect()  # our side only; the broker's RSS is what it is
    await asyncio.sleep(0.5)
    st = await _stats(stub)
    rss = proc.rss()
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
