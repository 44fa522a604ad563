"""The holder side of bench/data_path/gpu_check.py: a process with KV caches in VRAM and a pinned CPU tier.

It builds, for every (model, layout) of the plan, the KV cache an engine would
have (bench/data_path/kv_layouts.py, on `device`), offloads the first history's blocks to
a `CpuTierBuffer` (pinned under CUDA, as an engine's tier is), and registers
both with one `BlockMover`, plus two flat buffers (one on the device, one
pinned host) for the contiguous reads the adapter is compared with. The
reader computes every expected byte from the same seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench.data_path.kv_layouts import LAYOUTS, MODELS, ModelShape, fill, kv_caches

HOLDER = "gpucheck-holder"
FLAT_SEED = 7  # contents of the flat buffers
FIRST_REMOTE_BLOCK = 17  # a history sits at blocks 17.. of the holder's KV cache
GPU_TIERS, CPU_TIERS, FLAT_DEVICE_TIER, FLAT_HOST_TIER = 100, 200, 10, 20


@dataclass(frozen=True)
class Plan:
    models: tuple[str, ...]
    layouts: tuple[str, ...]
    histories: tuple[int, ...]  # tokens
    device: str  # "cuda" (VRAM) or "cpu" (the dry run: DRAM)

    def cases(self) -> list[tuple[str, str]]:
        return [(m, lay) for m in self.models for lay in self.layouts]

    def blocks(self, model: str, tokens: int) -> int:
        return max(1, tokens // MODELS[model].block_size)

    def max_blocks(self, model: str) -> int:
        return self.blocks(model, max(self.histories))

    def pool(self, model: str) -> int:
        """KV blocks per side: the longest history at FIRST_REMOTE_BLOCK, and room around it."""
        return self.max_blocks(model) + FIRST_REMOTE_BLOCK + 8

    def flat_bytes(self) -> int:
        return max(self.max_blocks(m) * MODELS[m].block_bytes for m in self.models)

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.device == "cuda" else "DRAM"


def seed_of(model: str, layout: str) -> int:
    return 11 + 97 * sorted(MODELS).index(model) + LAYOUTS.index(layout)


def shape_of(model: str) -> ModelShape:
    return MODELS[model]


def holder_main(conn: Connection, plan: Plan) -> None:
    """Build, register, send what the reader needs, then serve until told to stop."""
    from kvbroker.engine_adapter.block_mover import BlockMover
    from kvbroker.engine_adapter.cpu_tier import CpuTierBuffer
    from kvbroker.engine_adapter.kv_regions import Region, regions_from_kv_caches
    from kvbroker.engine_adapter.nixl_agent import exit_skipping_nixl_teardown

    try:
        mover = BlockMover(HOLDER)
        keep: list[Any] = []
        info: dict[str, Any] = {"gpu": {}, "cpu": {}}
        for i, (model, layout) in enumerate(plan.cases()):
            pool, n = plan.pool(model), plan.max_blocks(model)
            kv = kv_caches(MODELS[model], layout, pool, seed_of(model, layout), plan.device)
            regions, num_blocks, mem = regions_from_kv_caches(kv)
            mover.register_tier(GPU_TIERS + i, mem, regions, num_blocks)
            tier = CpuTierBuffer(regions, n)
            tier.wait(tier.start_store(kv, range(FIRST_REMOTE_BLOCK, FIRST_REMOTE_BLOCK + n), range(n)))
            tier.poll()
            mover.register_tier(CPU_TIERS + i, tier.mem_type, tier.regions(), n)
            keep += [kv, tier]
            info["gpu"][(model, layout)] = (regions, num_blocks)
            info["cpu"][(model, layout)] = (tier.regions(), n, tier.pinned)
        size = plan.flat_bytes()
        flat = torch.empty(size, dtype=torch.uint8, device=plan.device)
        host = torch.empty(size, dtype=torch.uint8, pin_memory=plan.device == "cuda")
        fill(flat, FLAT_SEED)
        fill(host, FLAT_SEED)
        for tier_id, buf, mem in ((FLAT_DEVICE_TIER, flat, plan.mem_type), (FLAT_HOST_TIER, host, "DRAM")):
            dev = max(buf.get_device(), 0)
            mover.register_tier(tier_id, mem, [Region(0, buf.data_ptr(), size, size, dev)], 1)
        keep += [flat, host]
        info["flat_device"], info["flat_host"] = flat.data_ptr(), host.data_ptr()
        if plan.device == "cuda":
            torch.cuda.synchronize()
        info["metadata"] = mover.agent_metadata()
    except Exception as exc:  # the reader reports it and goes on with the parts that need no holder
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        exit_skipping_nixl_teardown(1)
    conn.send(info)
    conn.recv()  # "stop"; the mover's ticker answers the reader's handshakes meanwhile
    mover.close()
    exit_skipping_nixl_teardown(0)
