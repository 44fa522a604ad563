"""The shared store's memory against --index-max-entries, with ten times more blocks announced.

A real redis-server and a real `kvbroker serve --state redis://... --index-max-entries N`;
four engines (EngineSession, real gRPC) announce chains of 64 random blocks until `--factor`
times N went in, and a reader resolves recent chains after every round (matches keep entries).
The index's own keys in the store (the namespaces' `ix` hash, `lru` sorted set and counters:
Redis's MEMORY USAGE of each) are measured when the index first reaches the bound, after every
round (the peak) and at the end; Redis's whole `used_memory` growth is printed too, which adds
the mirror change stream (the last minute of every index change, trimmed by age: KEEP_MS in
broker/fleet/mirror.py; under a bytes budget also by count, to its share of the budget). Entries and entries forgotten come from the broker's
/metrics. An unbounded broker over its own redis-server given the same workload shows
what the bound saves, and what the bound's bookkeeping (a sorted set beside the index) costs a
block.

    python -m bench.scale.store_index_bound            # N = 100,000, x10
    python -m bench.scale.store_index_bound --quick    # N = 20,000, x10
    python -m bench.scale.store_index_bound --memory-mib 16 --no-reference
        # a bytes budget instead (--index-memory-mib 16 with --state: an entry bound derived
        # from the store's MEMORY USAGE, broker/fleet/index_bytes.py), ten times the entries
        # the prior figure (163 bytes an entry) allows; target: the index keys and the mirror
        # streams, and the store's whole used_memory growth, within 10% of the budget (peaks
        # after every round). Writes store_index_bytes.json.

Target (issue 31, item 5, for --state): past the bound the index's memory in the store stays
within 10% of what it was at the bound. Writes bench/results/store_index_bound.json (-quick with --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from bench.harness.output import format_table, load_note, log, write_json
from kvbroker.clients.engine_session import EngineSession
from kvbroker.clients.errors import Unavailable
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.metrics import scrape
from testkit.ports import free_port
from testkit.processes import SERVE, BrokerProcess
from testkit.redis_server import running_redis

MIB = 1024 * 1024
CHAIN = 64
ENGINES = 4
CHAINS_PER_ROUND = 16  # per engine: 4,096 blocks a round


def _metrics(port: int) -> dict[str, float]:
    return scrape(port, "kvbroker_index_", timeout=30)


async def _retried(call: Any, stalls: list[int]) -> Any:
    """`call()` again after a store stall (a call past the broker's 250 ms store timeout on a loaded
    machine answers UNAVAILABLE and the broker fails fast for a moment); counted in `stalls`."""
    for _ in range(20):
        try:
            return await call()
        except Unavailable:
            stalls[0] += 1
            await asyncio.sleep(0.5)
    return await call()


async def run_one(bound: int, blocks: int, log_dir: Path, memory_mib: int = 0) -> dict[str, Any]:
    """One broker over its own redis-server, `bound` entries (0: unbounded) or a `memory_mib`
    budget, `blocks` announced."""
    with running_redis(log_dir / f"redis-{bound}-{memory_mib}") as server:
        store = redis.Redis.from_url(server.url)
        port = free_port()
        limit = ["--index-memory-mib", str(memory_mib)] if memory_mib else ["--index-max-entries", str(bound)]
        args = ["--state", server.url, *limit, "--metrics-port", str(port)]
        reach = bound or memory_mib * MIB // 163  # announced past this: "at the bound"
        broker = BrokerProcess(
            log_dir,
            [*args, "--log-level", "WARNING"],
            command=SERVE,
            log_name=f"broker-{bound}.log",
            log_level=None,
            priority=None,
        )
        broker.start()
        rng = random.Random(5)
        sessions = [EngineSession(broker.address, engine_info(f"e{i}", ranks=1)) for i in range(ENGINES)]
        reader = EngineSession(broker.address, engine_info("reader", ranks=1))
        try:
            for s in [*sessions, reader]:
                await s.start(wait_connected_s=30.0)
            ns = (reader.layout_id, "")

            def used() -> int:
                return int(store.info("memory")["used_memory"])

            def index_bytes() -> int:
                # The namespaces' keys; under a bytes budget also the mirror change streams
                # ("{mirror-...}"), which it covers (a share of it: broker/fleet/index_bytes.py).
                keys = [
                    k
                    for k in store.scan_iter(match="kvb:{*}:*", count=1000)
                    if memory_mib or b"{mirror-" not in k
                ]
                # Exact (SAMPLES 0) within a bound; sampled for the unbounded reference, whose exact
                # walk of a million entries would stall the store past the broker's call timeout.
                return sum(int(store.memory_usage(k, samples=0 if reach else 5) or 0) for k in keys)

            before = used()
            peak = used_peak = 0
            at_bound: int | None = None
            announced = matched = 0
            paused = 0.0
            stalls = [0]
            started = time.perf_counter()
            while announced < blocks:
                recent: list[list[int]] = []
                for s in sessions:
                    for _ in range(CHAINS_PER_ROUND):
                        chain = [rng.getrandbits(64) for _ in range(CHAIN)]
                        recent.append(chain)
                        s.announce_stored(ns, pb.TIER_GPU, chain)
                    announced += CHAINS_PER_ROUND * CHAIN
                for s in sessions:
                    await _retried(lambda s=s: s.applied(timeout=300.0), stalls)
                for chain in rng.sample(recent, 8):  # recently used chains get matched
                    answer = await _retried(
                        lambda chain=chain: reader.resolve(ns, chain, timeout=60.0), stalls
                    )
                    matched += bool(answer.matches)
                measuring = time.perf_counter()
                now = index_bytes()
                paused += time.perf_counter() - measuring  # the announce rate leaves measuring out
                peak = max(peak, now)
                used_peak = max(used_peak, used() - before)
                if at_bound is None and reach and announced >= reach:
                    at_bound = now
            elapsed = time.perf_counter() - started - paused
            end = index_bytes()
            growth = used() - before
            metrics = _metrics(port)
            # Unbounded, the count is not kept: every random block announced is an entry.
            entries = int(metrics.get("kvbroker_index_entries", announced if not bound else 0))
            return {
                "bound_entries": bound,
                "budget_bytes": memory_mib * MIB,
                "entry_cap": int(metrics.get("kvbroker_index_entry_cap", bound)),
                "peak_over_budget": peak / (memory_mib * MIB) if memory_mib else None,
                "store_used_growth_over_budget": growth / (memory_mib * MIB) if memory_mib else None,
                "store_used_growth_peak_over_budget": used_peak / (memory_mib * MIB) if memory_mib else None,
                "blocks_announced": announced,
                "announce_blocks_per_s": announced / elapsed,
                "entries": entries,
                "forgotten": int(metrics["kvbroker_index_forgotten_total"]),
                "store_used_growth_bytes": growth,
                "index_bytes_at_bound": at_bound,
                "index_bytes": end,
                "index_bytes_peak": peak,
                "index_bytes_per_entry": end / entries if entries else None,
                "peak_over_at_bound": peak / at_bound if at_bound else None,
                "recent_chains_matched": matched,
                "store_stalls_retried": stalls[0],
            }
        finally:
            for s in [*sessions, reader]:
                await s.close()
            broker.stop()
            store.close()


async def main_async(args: argparse.Namespace) -> int:
    results = []
    with tempfile.TemporaryDirectory(prefix="kvb-store-bound-") as tmp:
        if args.memory_mib:
            blocks = args.factor * (args.memory_mib * MIB // 163)
            log(f"budget {args.memory_mib} MiB: announcing {blocks:,} blocks")
            results.append(await run_one(0, blocks, Path(tmp), args.memory_mib))
        else:
            blocks = args.factor * args.bound
            log(f"bound {args.bound:,} entries: announcing {blocks:,} blocks")
            results.append(await run_one(args.bound, blocks, Path(tmp)))
        if not args.no_reference:
            log(f"unbounded reference: {blocks:,} blocks")
            results.append(await run_one(0, blocks, Path(tmp)))
    rows = [
        [
            f"{r['bound_entries']:,}"
            if r["bound_entries"]
            else f"{r['budget_bytes'] / MIB:.0f} MiB (cap {r['entry_cap']:,})"
            if r["budget_bytes"]
            else "unbounded",
            f"{r['blocks_announced']:,}",
            f"{r['entries']:,}",
            f"{r['forgotten']:,}",
            f"{r['index_bytes_at_bound'] / MIB:.1f}" if r["index_bytes_at_bound"] else "-",
            f"{r['index_bytes'] / MIB:.1f}",
            f"{r['index_bytes_peak'] / MIB:.1f}",
            f"{r['peak_over_at_bound']:.2f}" if r["peak_over_at_bound"] else "-",
            f"{r['index_bytes_per_entry']:.0f}" if r["index_bytes_per_entry"] else "-",
            f"{r['store_used_growth_bytes'] / MIB:.1f}",
            f"{r['announce_blocks_per_s']:,.0f}",
        ]
        for r in results
    ]
    headers = [
        "bound",
        "announced",
        "entries",
        "forgotten",
        "index at bound MiB",
        "index MiB",
        "index peak MiB",
        "peak/at bound",
        "index bytes/entry",
        "used_memory growth MiB",
        "announce blocks/s",
    ]
    print(format_table(headers, rows))
    print(
        f"load average: {load_note()}; index: MEMORY USAGE of the namespaces' keys (exact with a bound; "
        "with --memory-mib the mirror change streams too, which the budget covers); used_memory growth: "
        "the whole store's (with the streams, and lease and registry keys)"
    )
    stalls = sum(r["store_stalls_retried"] for r in results)
    if stalls:
        print(f"store stalls retried (a call past the 250 ms store timeout on this machine): {stalls}")
    bounded = [r for r in results if r["bound_entries"]]
    verdict = all(r["peak_over_at_bound"] is not None and r["peak_over_at_bound"] <= 1.10 for r in bounded)
    target = "the index keys' peak MEMORY USAGE <= 1.10 x theirs when the index first reached the bound"
    if args.memory_mib:
        budgeted = [r for r in results if r["budget_bytes"]]
        verdict = all(
            r["peak_over_budget"] <= 1.10 and r["store_used_growth_peak_over_budget"] <= 1.10
            for r in budgeted
        )
        target = (
            "the budgeted keys' (index and mirror streams) peak MEMORY USAGE and the store's peak "
            "used_memory growth <= 1.10 x the budget (--index-memory-mib)"
        )
        overs = ", ".join(f"{r['peak_over_budget']:.3f}" for r in budgeted)
        used_overs = ", ".join(f"{r['store_used_growth_peak_over_budget']:.3f}" for r in budgeted)
        print(f"peak over budget: index and streams {overs}, the store's used_memory growth {used_overs}")
    print(f"target: {target}: {'met' if verdict else 'NOT met'}")
    name = "store_index_bytes" if args.memory_mib else "store_index_bound"
    path = write_json(
        f"{name}-quick" if args.quick else name,
        {
            "factor": args.factor,
            "load_average": load_note(),
            "target": target,
            "target_met": verdict,
            "results": results,
        },
        Path(args.out_dir) if args.out_dir else None,
    )
    log(f"wrote {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a bound of 20,000 entries")
    ap.add_argument(
        "--bound", type=int, default=0, help="--index-max-entries (default 100,000; quick 20,000)"
    )
    ap.add_argument("--factor", type=int, default=10, help="blocks announced, in multiples of the bound")
    ap.add_argument("--no-reference", action="store_true", help="skip the unbounded broker")
    ap.add_argument(
        "--memory-mib", type=int, default=0, help="a bytes budget (--index-memory-mib) instead of --bound"
    )
    ap.add_argument("--out-dir", default="", help="where the JSON goes (default bench/results)")
    args = ap.parse_args()
    args.bound = args.bound or (20_000 if args.quick else 100_000)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
