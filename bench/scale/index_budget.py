"""The broker's RSS against --index-memory-mib, with ten times more blocks announced than fit.

For each budget a real `kvbroker serve` process starts with --index-memory-mib;
four engines (EngineSession, real gRPC) announce chains of 64 random blocks
until `--factor` times the budget's entry cap went in, and a reader resolves
recent chains after every round (matches keep entries). The broker's RSS is
read from /proc before the first announcement (engines connected, index
empty) and after every round; the index's own estimate, entries and entries
forgotten come from its /metrics. An unbounded broker given the same
workload shows what the budget saves.

    python -m bench.scale.index_budget              # budgets 16 and 64 MiB, x10
    python -m bench.scale.index_budget --quick      # 8 MiB, x10

Target (issue 31): RSS growth of the broker within 10% of the budget.
Writes bench/results/index_budget.json (index_budget-quick.json with --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.loops import rss_bytes
from bench.harness.output import format_table, load_note, log, write_json
from kvbroker.clients.engine_session import EngineSession
from kvbroker.common.index import CompactPrefixIndex
from kvbroker.common.index_budget import KEY_BYTES, shard_cap
from kvbroker.common.model import Namespace, Tier
from kvbroker.v1 import broker_pb2 as pb
from testkit.builders import engine_info
from testkit.metrics import scrape
from testkit.ports import free_port
from testkit.processes import SERVE, BrokerProcess

MIB = 1024 * 1024
CHAIN = 64
ENGINES = 4
CHAINS_PER_ROUND = 16  # per engine: 4,096 blocks a round
SHARDS = 256


def _metrics(port: int) -> dict[str, float]:
    return scrape(port, "kvbroker_index_", timeout=30)


async def run_one(mib: int, blocks: int, log_dir: Path) -> dict[str, Any]:
    """One broker with a budget of `mib` MiB (0: unbounded) and `blocks` blocks announced."""
    port = free_port()
    args = ["--index-memory-mib", str(mib), "--metrics-port", str(port), "--log-level", "WARNING"]
    broker = BrokerProcess(
        log_dir, args, command=SERVE, log_name=f"broker-{mib}.log", log_level=None, priority=None
    )
    broker.start()
    rng = random.Random(5)
    sessions = [EngineSession(broker.address, engine_info(f"e{i}", ranks=1)) for i in range(ENGINES)]
    reader = EngineSession(broker.address, engine_info("reader", ranks=1))
    try:
        for s in [*sessions, reader]:
            await s.start(wait_connected_s=30.0)
        ns = (reader.layout_id, "")
        rss0 = rss_bytes(broker.pid)
        peak = rss0
        recent: list[list[int]] = []
        announced = 0
        matched = 0
        started = time.perf_counter()
        while announced < blocks:
            recent = []
            for s in sessions:
                for _ in range(CHAINS_PER_ROUND):
                    chain = [rng.getrandbits(64) for _ in range(CHAIN)]
                    recent.append(chain)
                    s.announce_stored(ns, pb.TIER_GPU, chain)
                announced += CHAINS_PER_ROUND * CHAIN
            for s in sessions:
                await s.applied(timeout=120.0)
            for chain in rng.sample(recent, 8):  # recently used chains get matched
                answer = await reader.resolve(ns, chain, timeout=60.0)
                matched += bool(answer.matches)
            peak = max(peak, rss_bytes(broker.pid))
        elapsed = time.perf_counter() - started
        rss = rss_bytes(broker.pid)
        metrics = _metrics(port)
        budget = mib * MIB
        return {
            "budget_mib": mib,
            "budget_bytes": budget,
            "entry_cap": int(metrics["kvbroker_index_entry_cap"]),
            "blocks_announced": announced,
            "announce_blocks_per_s": announced / elapsed,
            "entries": int(metrics["kvbroker_index_entries"]),
            "forgotten": int(metrics["kvbroker_index_forgotten_total"]),
            "estimated_bytes": int(metrics["kvbroker_index_memory_estimated_bytes"]),
            "rss_before_bytes": rss0,
            "rss_growth_bytes": rss - rss0,
            "rss_growth_peak_bytes": peak - rss0,
            "rss_growth_over_budget": (rss - rss0) / budget if budget else None,
            "rss_growth_peak_over_budget": (peak - rss0) / budget if budget else None,
            "recent_chains_matched": matched,
        }
    finally:
        for s in [*sessions, reader]:
            await s.close()
        broker.stop()


def in_process(mib: int, blocks: int, repetitions: int) -> dict[str, Any]:
    """What the budget costs the index alone: add rate and a 64-block lookup, bounded against
    unbounded, alternating in this process (the same chains, four engines)."""
    ns = Namespace("bench-layout", "")
    rng = random.Random(9)
    chains = [[rng.getrandbits(64) for _ in range(CHAIN)] for _ in range(blocks // CHAIN)]
    figures: dict[str, dict[str, list[float]]] = {"unbounded": {}, "bounded": {}}
    for _ in range(repetitions):
        for name, budget in (("unbounded", 0), ("bounded", mib * MIB)):
            index = CompactPrefixIndex(memory_budget=budget)
            started = time.perf_counter()
            for i, chain in enumerate(chains):
                index.add(f"e{i % ENGINES}", Tier.GPU, ns, chain)
            add_s = time.perf_counter() - started
            hot = chains[-1]
            started = time.perf_counter()
            for _ in range(5_000):
                index.longest_prefixes(ns, hot)
            lookup_s = (time.perf_counter() - started) / 5_000
            figures[name].setdefault("add_blocks_per_s", []).append(len(chains) * CHAIN / add_s)
            figures[name].setdefault("lookup_64_us", []).append(lookup_s * 1e6)
            del index
    return {
        "budget_mib": mib,
        "blocks": len(chains) * CHAIN,
        "repetitions": repetitions,
        **{
            name: {key: statistics.median(values) for key, values in per.items()}
            for name, per in figures.items()
        },
    }


def _cap(mib: int) -> int:
    return shard_cap(mib * MIB, SHARDS) * SHARDS


async def main_async(args: argparse.Namespace) -> int:
    budgets = [int(b) for b in args.budgets.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="kvb-index-budget-") as tmp:
        for mib in budgets:
            blocks = args.factor * _cap(mib)
            log(f"budget {mib} MiB: cap {_cap(mib):,} entries, announcing {blocks:,} blocks")
            results.append(await run_one(mib, blocks, Path(tmp)))
        if not args.no_reference:
            mib = budgets[0]
            log(f"unbounded reference: the {mib} MiB workload without a budget")
            results.append(await run_one(0, args.factor * _cap(mib), Path(tmp)))
    rows = [
        [
            f"{r['budget_mib']} MiB" if r["budget_mib"] else "unbounded",
            f"{r['blocks_announced']:,}",
            f"{r['entries']:,}",
            f"{r['forgotten']:,}",
            f"{r['estimated_bytes'] / MIB:.1f}",
            f"{r['rss_growth_bytes'] / MIB:.1f}",
            f"{r['rss_growth_peak_bytes'] / MIB:.1f}",
            f"{r['rss_growth_over_budget']:.2f}" if r["budget_mib"] else "-",
            f"{r['announce_blocks_per_s']:,.0f}",
        ]
        for r in results
    ]
    print(
        format_table(
            [
                "budget",
                "announced",
                "entries",
                "forgotten",
                "estimate MiB",
                "RSS growth MiB",
                "peak MiB",
                "growth/budget",
                "announce blocks/s",
            ],
            rows,
        )
    )
    print(f"load average: {load_note()}; estimate: the index's tables plus {KEY_BYTES} bytes a key")
    cost = in_process(budgets[0], args.factor * _cap(budgets[0]), args.repetitions)
    print(
        format_table(
            ["index alone (in process)", "add blocks/s", "lookup of 64 blocks, us"],
            [
                [name, f"{cost[name]['add_blocks_per_s']:,.0f}", f"{cost[name]['lookup_64_us']:.1f}"]
                for name in ("unbounded", "bounded")
            ],
        )
    )
    bounded = [r for r in results if r["budget_mib"]]
    verdict = all(r["rss_growth_peak_over_budget"] <= 1.10 for r in bounded)
    print(f"target: RSS growth within 10% of the budget: {'met' if verdict else 'NOT met'}")
    name = "index_budget-quick" if args.quick else "index_budget"
    path = write_json(
        name,
        {
            "factor": args.factor,
            "load_average": load_note(),
            "target": "broker RSS growth <= 1.10 x --index-memory-mib with 10x the cap announced",
            "target_met": verdict,
            "results": results,
            "in_process": cost,
        },
        Path(args.out_dir) if args.out_dir else None,
    )
    log(f"wrote {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one budget of 8 MiB")
    ap.add_argument("--budgets", default=None, help="comma-separated MiB (default 16,64; quick 8)")
    ap.add_argument("--factor", type=int, default=10, help="blocks announced, in multiples of the cap")
    ap.add_argument("--no-reference", action="store_true", help="skip the unbounded broker")
    ap.add_argument("--repetitions", type=int, default=3, help="in-process cost runs (median)")
    ap.add_argument("--out-dir", default="", help="where the JSON goes (default bench/results)")
    args = ap.parse_args()
    args.budgets = args.budgets or ("8" if args.quick else "16,64")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
