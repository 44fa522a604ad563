"""What a live lease costs the broker in memory: bytes per block hash, packed vs Python ints.

The in-memory lease table (broker/leases.py) keeps each lease's block hashes and
block ids. It now packs them (array('Q') and array('I'): 12 bytes a block); the
broker before kept tuples of Python ints (a 64-bit hash is a 32-byte int object
plus an 8-byte slot, a block id another 8-byte slot and often an int object).
This program creates leases of several sizes through the real
``InMemoryLeaseTable.create``, each from a fresh list of random 64-bit hashes
(as a decoded request gives them), and measures with tracemalloc what stays
allocated: once as the table keeps them now ("packed"), once with the same
leases' hashes and ids turned back into tuples of ints ("tuple", the former
representation). It also reports the fixed cost of a lease (a one-block lease)
and the cap ``--lease-memory-mib`` derives at the defaults.

    python -m bench.control_plane.lease_memory [--blocks 1000000]

Prints a table and writes bench/results/lease_memory.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tracemalloc
from pathlib import Path
from typing import Any

from bench.harness.output import write_result
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.leases import BYTES_PER_BLOCK, BYTES_PER_LEASE, InMemoryLeaseTable
from kvbroker.common.model import LeaseState, Namespace, Tier

RESULTS = Path(__file__).resolve().parents[1] / "results" / "lease_memory.json"
SIZES = (1, 16, 256, 8_192)


def _fill(lease_blocks: int, total_blocks: int, as_tuples: bool, seed: int) -> tuple[int, int]:
    """(bytes still allocated, leases) after creating leases of `lease_blocks` up to `total_blocks`."""
    rng = random.Random(seed)
    ns = Namespace("bench-layout", "acme")
    leases = max(1, total_blocks // lease_blocks)
    gc.collect()
    tracemalloc.start()
    table = InMemoryLeaseTable()
    for i in range(leases):
        hashes = [rng.getrandbits(64) for _ in range(lease_blocks)]
        ids = [rng.randrange(1, 200_000) for _ in range(lease_blocks)]
        lease = table.create(
            holder=f"engine-{i % 64}",
            reader=f"engine-{(i + 1) % 64}",
            namespace=ns,
            tier=Tier.GPU,
            block_hashes=hashes,
            block_ids=ids,
            state=LeaseState.HELD,
            ttl_s=30.0,
            deadline=30.0 + i,
            request_id=f"req-{i}",
        )
        if as_tuples:  # the former representation: tuples of Python ints
            lease.block_hashes = tuple(hashes)  # type: ignore[assignment]
            lease.block_ids = tuple(ids)  # type: ignore[assignment]
        del hashes, ids
    gc.collect()
    current, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del table
    return current, leases


def measure(total_blocks: int) -> dict[str, Any]:
    rows = []
    for size in SIZES:
        total = total_blocks if size > 1 else min(total_blocks, 100_000)
        row: dict[str, Any] = {"lease_blocks": size}
        for kind in ("tuple", "packed"):
            used, leases = _fill(size, total, kind == "tuple", seed=size)
            row["leases"] = leases
            row[f"{kind}_bytes_per_lease"] = round(used / leases, 1)
            row[f"{kind}_bytes_per_block"] = round(used / (leases * size), 2)
        rows.append(row)
    fixed = next(r for r in rows if r["lease_blocks"] == 1)
    big = next(r for r in rows if r["lease_blocks"] == max(SIZES))
    config = BrokerConfig()
    return {
        "benchmark": "lease_memory",
        "python": sys.version.split()[0],
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "total_blocks": total_blocks,
        "rows": rows,
        # A large lease's cost per block, beyond its fixed cost: what a hash costs.
        "tuple_bytes_per_hash": round(
            (big["tuple_bytes_per_lease"] - fixed["tuple_bytes_per_lease"]) / (max(SIZES) - 1), 2
        ),
        "packed_bytes_per_hash": round(
            (big["packed_bytes_per_lease"] - fixed["packed_bytes_per_lease"]) / (max(SIZES) - 1), 2
        ),
        "packed_bytes_per_lease_fixed": fixed["packed_bytes_per_lease"],
        "model_bytes_per_block": BYTES_PER_BLOCK,
        "model_bytes_per_lease": BYTES_PER_LEASE,
        "defaults": {
            "lease_memory_mib": config.lease_memory_mib,
            "max_lease_blocks": config.max_lease_blocks,
            "leases_per_engine": config.leases_per_engine,
            "one_engine_pins_mib_as_holder": round(
                config.leases_per_engine
                * (config.max_lease_blocks * BYTES_PER_BLOCK + BYTES_PER_LEASE)
                / 2**20,
                1,
            ),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks over all leases, per size")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = measure(args.blocks)
    print(f"{'lease blocks':>12} {'leases':>8} {'tuple B/block':>14} {'packed B/block':>15}")
    for row in result["rows"]:
        print(
            f"{row['lease_blocks']:>12} {row['leases']:>8} {row['tuple_bytes_per_block']:>14} "
            f"{row['packed_bytes_per_block']:>15}"
        )
    print(
        f"bytes per hash: tuple {result['tuple_bytes_per_hash']}, packed {result['packed_bytes_per_hash']}; "
        f"fixed per lease (packed): {result['packed_bytes_per_lease_fixed']} "
        f"(the cap's model: {BYTES_PER_BLOCK} per block + {BYTES_PER_LEASE} per lease)"
    )
    d = result["defaults"]
    print(
        f"defaults: --lease-memory-mib {d['lease_memory_mib']} -> {d['leases_per_engine']} leases per engine "
        f"of up to {d['max_lease_blocks']} blocks = {d['one_engine_pins_mib_as_holder']} MiB at most as holder; "
        f"load average {result['load_average']}"
    )
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
