"""A holder engine rank in its own process: real KV tensors, a CPU tier, a real BlockMover.

Started with multiprocessing's spawn context; talks to the test over a Pipe.
The KV cache is rebuilt from a seed, so the test process can compute every
expected byte without shipping tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

GPU, CPU = 1, 2


@dataclass(frozen=True)
class PeerSpec:
    agent_name: str
    seed: int
    num_layers: int = 3
    num_blocks: int = 24
    kv_heads: int = 2
    block_size: int = 32
    head_size: int = 16
    num_slots: int = 8

    def kv_kwargs(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "kv_heads": self.kv_heads,
            "block_size": self.block_size,
            "head_size": self.head_size,
        }

    def slot_of_block(self) -> dict[int, int]:
        """Blocks the holder offloads to its CPU tier: block num_blocks-1-s goes to slot s."""
        return {self.num_blocks - 1 - s: s for s in range(self.num_slots)}


def peer_main(conn: Connection, spec: PeerSpec) -> None:
    from engine_adapter.block_mover import BlockMover
    from engine_adapter.cpu_tier import CpuTierBuffer
    from engine_adapter.kv_regions import regions_from_kv_caches
    from tests.data_path.kv_fixtures import cpu_backend_kv_caches

    kv = cpu_backend_kv_caches(seed=spec.seed, **spec.kv_kwargs())
    regions, num_blocks, mem_type = regions_from_kv_caches(kv)
    tier = CpuTierBuffer(regions, spec.num_slots, pin_memory=False)
    offload = spec.slot_of_block()
    tier.wait(tier.start_store(kv, list(offload), list(offload.values())))
    tier.poll()
    mover = BlockMover(spec.agent_name)
    mover.register_tier(GPU, mem_type, regions, num_blocks)
    mover.register_tier(CPU, tier.mem_type, tier.regions(), tier.num_slots)
    conn.send(
        {
            "pid": os.getpid(),
            "metadata": mover.agent_metadata(),
            "gpu_regions": regions,
            "num_blocks": num_blocks,
            "cpu_regions": tier.regions(),
            "num_slots": tier.num_slots,
        }
    )
    # The mover's ticker answers readers' handshakes; this loop only serves the test.
    while True:
        cmd = conn.recv()
        if cmd == "notifications":
            conn.send(mover.take_notifications())
        elif cmd == "stop":
            mover.close()
            tier.close()
            conn.send("stopped")
            return
