"""The broker's prefix index alone, in a fresh process: memory per block and in-process lookup time.

This isolates the index from gRPC and from the rest of the broker: a fresh Python
process builds ``kvbroker.common.index.CompactPrefixIndex`` with the same shape of data as the
process benchmark (random 64-bit hashes announced by N engines in 16 namespaces)
and reports the RSS delta per indexed block at each size, the rate of ``add`` and
the time of ``longest_prefixes`` over a held 64-block chain (what a resolve costs
without any RPC).

    python -m bench.control_plane.index_memory --blocks 1000000,10000000 --engines 1000

Prints one JSON object on stdout (bench.control_plane.broker runs it as a child process).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def measure(sizes: list[int], engines: int, batch: int = 8192) -> dict[str, object]:
    from kvbroker.common.index import CompactPrefixIndex
    from kvbroker.common.model import Namespace, Tier

    rng = random.Random(3)
    namespaces = [Namespace("bench-layout", f"m{i}") for i in range(16)]
    gc.collect()
    index = CompactPrefixIndex()
    base = _rss()
    points = []
    loaded = 0
    add_s = 0.0
    for target in sorted(sizes):
        while loaded < target:
            e = loaded // batch % engines
            n = min(batch, target - loaded)
            hashes = [rng.getrandbits(64) for _ in range(n)]
            t = time.perf_counter()
            index.add(f"bench-e{e:04d}", Tier.GPU, namespaces[e % 16], hashes)
            add_s += time.perf_counter() - t
            loaded += n
            del hashes
        gc.collect()
        rss = _rss()
        points.append(
            {
                "blocks": index.total_blocks(),
                "rss_delta_bytes": rss - base,
                "bytes_per_block": (rss - base) / max(1, index.total_blocks()),
                "add_blocks_per_s": loaded / add_s if add_s else None,
            }
        )
        print(
            f"index alone: {points[-1]['bytes_per_block']:.0f} B/block at {target:,}",
            file=sys.stderr,
            flush=True,
        )
    # In-process lookup of a held 64-block chain.
    chain = [rng.getrandbits(64) for _ in range(64)]
    index.add("bench-e0000", Tier.GPU, namespaces[0], chain)
    lat = []
    r: list[tuple[str, Tier, int]] = []
    for _ in range(20_000):
        t = time.perf_counter()
        r = index.longest_prefixes(namespaces[0], chain)
        lat.append(time.perf_counter() - t)
    assert r and r[0][2] == 64, r
    lat.sort()
    return {
        "points": points,
        "engines": engines,
        "namespaces": len(namespaces),
        "lookup_64_p50_us": lat[len(lat) // 2] * 1e6,
        "lookup_64_p99_us": lat[int(len(lat) * 0.99)] * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", default="1000000,10000000", help="comma-separated sizes")
    p.add_argument("--engines", type=int, default=1000)
    args = p.parse_args()
    sizes = [int(x) for x in args.blocks.split(",") if x]
    print(json.dumps(measure(sizes, args.engines)))


if __name__ == "__main__":
    main()
