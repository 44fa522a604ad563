"""The broker's inventory rate: blocks announced per second and broker CPU per block,
over raw session streams and through the client library's EngineSession."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from bench.control_plane.chains import BLOCK_WIRE_BYTES, CHAIN_LEN, make_chains
from bench.control_plane.driver import RawSession, bench_engine
from bench.control_plane.measure import Settings
from bench.harness.loops import cpu_seconds
from bench.harness.output import log
from kvbroker.clients.engine_session import EngineSession
from kvbroker.v1 import broker_pb2 as pb
from testkit.processes import BrokerProcess


async def measure_inventory(
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


async def measure_inventory_engine_sessions(
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

    return {
        "blocks_per_s": spread(figs),
        "server_cpu_ns_per_block": spread(cpu_ns),
        "bytes_per_block": BLOCK_WIRE_BYTES,  # at least its hash crosses a socket: the memcpy check
        **extra,
    }


def _median(xs: Sequence[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else (ys[n // 2 - 1] + ys[n // 2]) / 2
