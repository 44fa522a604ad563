"""bench.scale.replicas's engine-side mirror, in a process of its own: a fresh heap per setup, so the
setups compare the mirror, not what earlier setups left in the benchmark's memory.

    python -m bench.scale.mirror ADDRESS LAYOUT_ID BLOCKS RESOLVES

Follows ADDRESS's Mirror stream of LAYOUT_ID and prints `synced`; then, once a line arrives on
stdin, waits until the mirror holds BLOCKS blocks, answers RESOLVES resolves of bench.scale.replicas's
chains (asker D, as the engine adapter asks) and prints one JSON line: p50/p99 per resolve and
this process's CPU per resolve.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

import grpc

from bench.scale.chains import CHAIN, chains_for
from kvbroker.clients.mirror import IndexMirror, follow
from testkit.builders import engine_info


async def main(address: str, layout_id: str, blocks: int, resolves: int) -> int:
    chains = chains_for(blocks)
    mirror = IndexMirror(layout_id)
    async with grpc.aio.insecure_channel(address) as channel:
        task = asyncio.create_task(follow(mirror, channel))
        started = time.monotonic()
        while not mirror.synced:
            if task.done() or time.monotonic() - started > 30.0:
                raise RuntimeError(f"mirror did not sync: {mirror.stats.errors}")
            await asyncio.sleep(0.01)
        print("synced", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        started = time.monotonic()
        while mirror.total_blocks() < blocks:  # the last changes may still be on their way
            if task.done() or time.monotonic() - started > 60.0:
                raise RuntimeError(f"mirror has {mirror.total_blocks()} of {blocks} blocks")
            await asyncio.sleep(0.01)
        asker = engine_info("D")
        times: list[float] = []
        cpu0 = time.process_time()
        for i in range(resolves):  # no await in here: nothing changes the mirror meanwhile
            chain = chains[i % len(chains)]
            t0 = time.perf_counter()
            found = mirror.resolve("", chain, asker=asker)
            times.append(time.perf_counter() - t0)
            assert found and found[0].matched_blocks == CHAIN and found[0].engine_id == "P", found
        cpu = (time.process_time() - cpu0) / resolves * 1e6
        times.sort()
        task.cancel()
    result = {
        "mirror_cpu_us_per_resolve": cpu,
        "mirror_resolve_p50_us": statistics.median(times) * 1e6,
        "mirror_resolve_p99_us": times[min(len(times) - 1, int(0.99 * len(times)))] * 1e6,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    address, layout_id, blocks, resolves = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    raise SystemExit(asyncio.run(main(address, layout_id, blocks, resolves)))
