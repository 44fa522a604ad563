"""What a user would pick instead of the broker, under the same workload (see bench.control_plane.measure):
two bare grpc.aio echo servers (the floor any gRPC service pays), Redis and Mooncake's master."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from bench.control_plane.chains import BLOCK_WIRE_BYTES, CHAIN_LEN, make_chains
from bench.control_plane.measure import STREAM_METHOD, UNARY_METHOD, Settings, lookup_namespaces, run_async
from bench.control_plane.peers import GrpcEchoPeer, MooncakePeer, PeerUnavailable, RedisPeer, chain_keys
from bench.harness.loops import AsyncOp, RunResult, SyncOp, aggregate, closed_loop_async, closed_loop_threads
from bench.harness.output import log
from kvbroker.v1 import broker_pb2 as pb

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
    agg["bytes_per_block"] = BLOCK_WIRE_BYTES  # for the memcpy check (bench.harness.checks)
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
