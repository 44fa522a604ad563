"""How long one huge KV-event batch holds the broker's event loop.

A followed engine (broker/indexer/kv_events.py) publishes one batch of
120,000 BlockStored events (one chain, every block indexed). The real feed
and core apply it on an asyncio loop while a ticker task measures how late
each of its 1 ms sleeps wakes up: the worst lateness is the longest the loop
was held (GC pauses and a busy host included). The feed applies events in
slices of about SLICE_BUDGET_S and yields between them; before, the whole
batch was one turn of the loop.

    python -m bench.control_plane.kv_events_stall [--events 120000]

Prints the numbers and writes bench/results/kv_events_stall.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.output import write_result

RESULTS = Path(__file__).resolve().parents[1] / "results" / "kv_events_stall.json"
BLOCK = 32


def batch(events: int) -> bytes:
    """One msgpack batch of `events` chained BlockStored events, as vLLM publishes it."""
    import msgspec

    from kvbroker.common.hashing import hash_block, none_hash

    tokens = [1] * BLOCK
    digest, parent, out = none_hash(), None, []
    for _ in range(events):
        digest = hash_block("sha256", digest, tokens)
        block = int.from_bytes(digest, "big") & ((1 << 64) - 1)
        out.append(["BlockStored", [block], parent, tokens, BLOCK, None, "GPU"])
        parent = block
    return msgspec.msgpack.encode([time.time(), out, None])


async def apply_and_watch(payload: bytes) -> dict[str, Any]:
    """Apply `payload` through a real feed and core; the loop's worst lateness while it ran."""
    import msgspec

    from kvbroker.broker.channels import StreamNotifier
    from kvbroker.broker.clock import MonotonicClock
    from kvbroker.broker.config import BrokerConfig
    from kvbroker.broker.core import BrokerCore
    from kvbroker.broker.indexer.kv_events import SLICE_BUDGET_S, KvEventsFeed, _batch_splitter, parse_source

    clock = MonotonicClock()
    core = BrokerCore(BrokerConfig(), clock=clock, notifier=StreamNotifier(clock))
    feed = KvEventsFeed(core, parse_source(f"ev=tcp://127.0.0.1:1?model=m&block_size={BLOCK}"))
    feed.connected()
    lateness: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        while not done.is_set():
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            lateness.append(time.perf_counter() - started - 0.001)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    lateness.clear()
    started = time.perf_counter()
    events = _batch_splitter(msgspec, feed)(payload)
    assert events is not None
    await feed.apply_batch(0, events, msgspec.msgpack.Decoder().decode)
    total = time.perf_counter() - started
    done.set()
    await ticker
    lateness.sort()
    return {
        "events": len(events),
        "stored": feed.stats.stored,
        "payload_bytes": len(payload),
        "apply_s": round(total, 3),
        "loop_turns": len(lateness),
        "worst_stall_ms": round(lateness[-1] * 1000, 1),
        "p99_stall_ms": round(lateness[int(len(lateness) * 0.99)] * 1000, 1),
        "slice_budget_ms": SLICE_BUDGET_S * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=120_000)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = asyncio.run(apply_and_watch(batch(args.events)))
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(
        f"{result['events']} events ({result['payload_bytes'] / 2**20:.1f} MiB) applied in {result['apply_s']} s "
        f"over {result['loop_turns']} loop turns; worst stall {result['worst_stall_ms']} ms, "
        f"p99 {result['p99_stall_ms']} ms; load average {result['load_average']}"
    )
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
