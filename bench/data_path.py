"""Data path: the adapter's BlockMover vs raw NIXL vs a plain memory copy.

Two processes, each with a real BlockMover (one NIXL agent, UCX, progress
thread off): a holder with KV-shaped memory filled with random bytes, and a
reader that pulls blocks from it. For each block size (16 KiB to 2 MiB) the
reader moves the same bytes three ways, interleaved, in the same run:

- adapter:   BlockMover.start_read(...) + poll() until done (one NIXL READ of
             N blocks x L layers);
- raw NIXL:  a bare nixl_agent in the reader process reading the same blocks
             from the same holder memory (descriptor lists prepared once,
             then make_prepped_xfer + transfer + check_xfer_state + release);
- memcpy:    torch copy_ of the same number of bytes inside the reader.

Blocks are scattered (a random choice of half the holder's blocks, landing in
a random order) so NIXL cannot merge them: each block is its own descriptor,
as for a real KV read. The first adapter read of each size is checked byte for
byte before anything is timed.

    python -m bench.data_path                  # default (~1 minute)
    python -m bench.data_path --reps 15 --mib 256 --sizes 16,64,256,1024,2048

Prints a table (median GB/s, min-max over the repetitions, adapter/raw ratio)
and writes bench/results/data_path.json.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.checks import check_gbps, exit_code, is_invalid, report_invalid
from bench.common import RESULTS_DIR, log, write_json
from kvbroker.engine_adapter.nixl_agent import exit_skipping_nixl_teardown

NUM_LAYERS = 2  # regions per side; bytes per transfer are split evenly over them
TIER_BASE = 100  # tier id of the first block size (one registered tier per size)
HOLDER = "bench-holder"
READER = "bench-reader"


@dataclass(frozen=True)
class SizePlan:
    block_bytes: int
    blocks_per_transfer: int  # per layer
    pool_blocks: int  # blocks per layer the holder has (the reader picks half)
    seed: int

    @property
    def bytes_per_transfer(self) -> int:
        return self.block_bytes * self.blocks_per_transfer * NUM_LAYERS


def plans(sizes_kib: list[int], mib: int) -> list[SizePlan]:
    out = []
    for i, kib in enumerate(sizes_kib):
        block = kib * 1024
        n = max(1, (mib << 20) // (block * NUM_LAYERS))
        out.append(SizePlan(block, n, 2 * n, seed=1000 + i))
    return out


def layer_buffers(plan: SizePlan, fill: bool) -> torch.Tensor:
    """[layers, pool_blocks, block_bytes] bytes; random (seeded) on the holder, zeros on the reader."""
    shape = (NUM_LAYERS, plan.pool_blocks, plan.block_bytes)
    if not fill:
        return torch.zeros(shape, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(plan.seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def regions_of(buf: torch.Tensor) -> list[Any]:
    from kvbroker.engine_adapter.kv_regions import Region

    block = buf.shape[2]
    return [Region(layer, buf[layer].data_ptr(), block, block) for layer in range(buf.shape[0])]


# ---------------------------------------------------------------------- holder


def holder_main(conn: Connection, sizes: list[SizePlan]) -> None:
    from kvbroker.engine_adapter.block_mover import BlockMover

    mover = BlockMover(HOLDER)
    buffers = []
    regions = []
    for i, plan in enumerate(sizes):
        buf = layer_buffers(plan, fill=True)
        buffers.append(buf)
        regions.append(regions_of(buf))
        mover.register_tier(TIER_BASE + i, "DRAM", regions[-1], plan.pool_blocks)
    conn.send({"metadata": mover.agent_metadata(), "regions": regions})
    conn.recv()  # "stop"; the mover's ticker answers handshakes meanwhile
    mover.close()
    exit_skipping_nixl_teardown(0)


# ---------------------------------------------------------------------- reader


class RawNixlReader:
    """The same reads with direct nixl_agent calls: what a careful user of NIXL would write."""

    def __init__(self, holder_metadata: bytes) -> None:
        from kvbroker.engine_adapter.nixl_agent import create_agent, real_nixl

        self.agent = create_agent(real_nixl(), "bench-raw-reader")
        self.peer = self.agent.add_remote_agent(holder_metadata)
        self.peer = self.peer.decode() if isinstance(self.peer, bytes) else self.peer
        self.lists: dict[int, tuple[Any, Any]] = {}
        self.registered: list[Any] = []

    def prepare(self, key: int, local: torch.Tensor, remote_regions: list[Any], pool_blocks: int) -> None:
        self.registered.append(self.agent.register_memory([(local.data_ptr(), local.nbytes, 0, "")], "DRAM"))
        local_descs = descs_for(regions_of(local), pool_blocks)
        remote_descs = descs_for(remote_regions, pool_blocks)
        self.lists[key] = (
            self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, "DRAM"),
            self.agent.prep_xfer_dlist(self.peer, remote_descs, "DRAM"),
        )

    def read(self, key: int, local_idx: np.ndarray, remote_idx: np.ndarray) -> None:
        local, remote = self.lists[key]
        xfer = self.agent.make_prepped_xfer("READ", local, local_idx, remote, remote_idx, b"")
        state = self.agent.transfer(xfer)
        while state == "PROC":
            state = self.agent.check_xfer_state(xfer)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL read ended in state {state}")
        self.agent.release_xfer_handle(xfer)

    def close(self) -> None:
        """Release in dependency order: NIXL objects left to the garbage collector at
        interpreter exit can outlive their agent and crash the process."""
        for local, remote in self.lists.values():
            local.release()
            remote.release()
        self.lists.clear()
        for reg in self.registered:
            self.agent.deregister_memory(reg)
        self.registered.clear()
        self.agent.remove_remote_agent(self.peer)
        del self.agent


def descs_for(regions: list[Any], pool_blocks: int) -> np.ndarray:
    rows = [(r.base_addr + b * r.block_stride, r.block_bytes, 0) for r in regions for b in range(pool_blocks)]
    return np.array(rows, dtype=np.uint64)


def adapter_read(
    mover: Any, peer_regions: list[Any], remote: list[int], tier: int, local: list[int], n: int
) -> None:
    handle = mover.start_read(HOLDER, peer_regions, remote, tier, local, peer_num_blocks=n)
    while True:
        done, failed = mover.poll()
        if handle in failed:
            raise RuntimeError(f"adapter read failed: {failed[handle]}")
        if handle in done:
            return


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summary(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    gbps = sorted(nbytes / s / 1e9 for s in seconds)
    q = statistics.quantiles(gbps, n=4) if len(gbps) >= 2 else [gbps[0]] * 3
    return {
        "gbps_median": round(statistics.median(gbps), 3),
        "gbps_min": round(gbps[0], 3),
        "gbps_max": round(gbps[-1], 3),
        "gbps_p25": round(q[0], 3),
        "gbps_p75": round(q[2], 3),
        "samples_gbps": [round(g, 3) for g in gbps],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvbroker.engine_adapter.block_mover import BlockMover

    sizes = plans(args.sizes, args.mib)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    holder = ctx.Process(target=holder_main, args=(child, sizes), daemon=True)
    holder.start()
    try:
        log("holder starting (allocating and registering KV-shaped memory)")
        if not conn.poll(120):
            raise RuntimeError("holder process did not start")
        info = conn.recv()
        # The reader drives its own progress by polling; without its ticker
        # thread only the main thread calls into NIXL, so the raw agent in
        # this process needs no lock and raw NIXL stays exactly raw.
        mover = BlockMover(READER, progress_interval_s=None)
        mover.add_peer(HOLDER, info["metadata"])
        raw = RawNixlReader(info["metadata"])
        rng = np.random.default_rng(7)
        results = []
        for i, plan in enumerate(sizes):
            tier = TIER_BASE + i
            local = layer_buffers(plan, fill=False)
            mover.register_tier(tier, "DRAM", regions_of(local), plan.pool_blocks)
            raw_local = layer_buffers(plan, fill=False)
            raw.prepare(tier, raw_local, info["regions"][i], plan.pool_blocks)
            remote_ids = rng.choice(plan.pool_blocks, plan.blocks_per_transfer, replace=False)
            local_ids = rng.permutation(plan.pool_blocks)[: plan.blocks_per_transfer]
            remote_l, local_l = remote_ids.tolist(), local_ids.tolist()
            peer_regions = info["regions"][i]

            # Correctness first: the adapter's read must deliver exactly the holder's bytes.
            adapter_read(mover, peer_regions, remote_l, tier, local_l, plan.pool_blocks)
            expected = layer_buffers(plan, fill=True)
            if not torch.equal(local[:, local_ids], expected[:, remote_ids]):
                raise RuntimeError(f"adapter read of {plan.block_bytes} B blocks delivered wrong bytes")
            del expected
            raw_local_idx = np.concatenate(
                [layer * plan.pool_blocks + local_ids for layer in range(NUM_LAYERS)]
            )
            raw_remote_idx = np.concatenate(
                [layer * plan.pool_blocks + remote_ids for layer in range(NUM_LAYERS)]
            )
            raw_local_idx, raw_remote_idx = raw_local_idx.astype(np.int32), raw_remote_idx.astype(np.int32)
            raw.read(tier, raw_local_idx, raw_remote_idx)  # warm-up (connection, caches)
            if not torch.equal(raw_local[:, local_ids], local[:, local_ids]):
                raise RuntimeError("raw NIXL read delivered different bytes than the adapter")
            copy_src = torch.empty(plan.bytes_per_transfer, dtype=torch.uint8).fill_(1)
            copy_dst = torch.empty_like(copy_src)
            copy_dst.copy_(copy_src)

            methods: dict[str, Callable[[], object]] = {
                "adapter": partial(
                    adapter_read, mover, peer_regions, remote_l, tier, local_l, plan.pool_blocks
                ),
                "raw_nixl": partial(raw.read, tier, raw_local_idx, raw_remote_idx),
                "memcpy": partial(copy_dst.copy_, copy_src),
            }
            samples: dict[str, list[float]] = {name: [] for name in methods}
            order = list(methods)
            for rep in range(args.reps):
                # Rotate the order: whoever runs right after another read finds
                # part of the holder's bytes still in the shared L3 cache.
                for name in order[rep % 3 :] + order[: rep % 3]:
                    samples[name].append(timed(methods[name]))
            row: dict[str, Any] = {
                "block_bytes": plan.block_bytes,
                "blocks_per_transfer": plan.blocks_per_transfer * NUM_LAYERS,
                "bytes_per_transfer": plan.bytes_per_transfer,
                **{name: summary(plan.bytes_per_transfer, s) for name, s in samples.items()},
            }
            row["adapter_vs_raw"] = round(row["adapter"]["gbps_median"] / row["raw_nixl"]["gbps_median"], 3)
            results.append(row)
            log(
                f"{plan.block_bytes >> 10:>5} KiB blocks: adapter {row['adapter']['gbps_median']:.2f} GB/s, "
                f"raw {row['raw_nixl']['gbps_median']:.2f} GB/s, memcpy {row['memcpy']['gbps_median']:.2f} GB/s"
            )
        raw.close()
        mover.close()
        return {"results": results}
    finally:
        with contextlib.suppress(OSError):
            conn.send("stop")
        holder.join(30)
        if holder.is_alive():
            holder.kill()
            holder.join(5)


def print_table(doc: dict[str, Any]) -> None:
    print(
        f"{'block':>8} {'blocks':>7} {'MiB':>5} | {'adapter GB/s':>20} | {'raw NIXL GB/s':>20} | "
        f"{'memcpy GB/s':>20} | {'adapter/raw':>11}"
    )

    def cell(s: dict[str, Any]) -> str:
        text = f"{s['gbps_median']:6.2f} ({s['gbps_min']:.2f}-{s['gbps_max']:.2f})"
        return f"INVALID {text}" if is_invalid(s) else text

    for r in doc["results"]:
        print(
            f"{r['block_bytes'] >> 10:>5}KiB {r['blocks_per_transfer']:>7} {r['bytes_per_transfer'] >> 20:>5} | "
            f"{cell(r['adapter']):>20} | {cell(r['raw_nixl']):>20} | {cell(r['memcpy']):>20} | "
            f"{r['adapter_vs_raw']:>11.2f}"
        )
    print("GB/s: median (min-max) over repetitions; adapter/raw: ratio of medians (target >= 0.90)")
    print(report_invalid(doc.get("checks", {}).get("invalid", [])))


def check_rows(doc: dict[str, Any]) -> dict[str, Any]:
    """Every GB/s figure against memcpy of the same bytes on this machine (bench.checks)."""
    invalid: list[str] = []
    for r in doc["results"]:
        for method in ("adapter", "raw_nixl", "memcpy"):
            invalid += check_gbps(
                r[method], r["bytes_per_transfer"], f"{r['block_bytes'] >> 10} KiB {method}"
            )
    return {"invalid": invalid, "passed": not invalid}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[16, 64, 256, 1024, 2048],
        help="block sizes in KiB, comma separated (default 16,64,256,1024,2048)",
    )
    p.add_argument("--mib", type=int, default=64, help="MiB moved per transfer (default 64)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per size and method (default 7)")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="where data_path.json goes")
    p.add_argument("--name", default="data_path", help="JSON file name without .json (default data_path)")
    args = p.parse_args(argv)
    from kvbroker.engine_adapter.nixl_agent import nixl_available

    if not nixl_available():
        print(
            "NIXL is not installed: the data path benchmark needs it (pip install '.[cpu]')", file=sys.stderr
        )
        return 2
    started = time.monotonic()
    load_before = os.getloadavg()
    doc = run(args)
    doc["settings"] = {
        "sizes_kib": args.sizes,
        "mib_per_transfer": args.mib,
        "reps": args.reps,
        "layers": NUM_LAYERS,
        "backend": "UCX",
        "transport_note": "two processes on one machine; UCX moves DRAM between them (shared memory / CMA)",
        "torch_threads": torch.get_num_threads(),
        "wall_s": round(time.monotonic() - started, 1),
        # Other work on the machine moves every figure; record how busy it was.
        "load_avg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpu_count": os.cpu_count(),
    }
    doc["checks"] = check_rows(doc)
    print_table(doc)
    print(
        f"load average (1 min) before/after: {doc['settings']['load_avg_1m_before_after']} on {os.cpu_count()} cores"
    )
    path = write_json(args.name, doc, args.out_dir)
    print(f"wrote {path}")
    return exit_code(doc["checks"]["invalid"])


if __name__ == "__main__":
    exit_skipping_nixl_teardown(main())
