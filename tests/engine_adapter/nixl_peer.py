"""A holder engine rank in its own process: real KV tensors, a CPU tier, a real BlockMover.

Started with multiprocessing's spawn context; talks to the test over a Pipe.
The KV cache is rebuilt from a seed, so the test process can compute every
expected byte without shipping tensors.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from tests.engine_adapter.kv_fixtures import LAYER_NAME, cpu_backend_kv_caches

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
    device: str = "cpu"  # where the KV cache lives: cpu, or cuda for VRAM

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
    from kvbroker.engine_adapter.block_mover import BlockMover
    from kvbroker.engine_adapter.cpu_tier import CpuTierBuffer
    from kvbroker.engine_adapter.kv_regions import regions_from_kv_caches
    from kvbroker.engine_adapter.nixl_agent import exit_skipping_nixl_teardown

    kv = cpu_backend_kv_caches(seed=spec.seed, device=spec.device, **spec.kv_kwargs())
    regions, num_blocks, mem_type = regions_from_kv_caches(kv)
    tier = CpuTierBuffer(regions, spec.num_slots)
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
            exit_skipping_nixl_teardown(0)


class Peer:
    def __init__(self, spec: PeerSpec) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=peer_main, args=(child, spec), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 60
        while not self.conn.poll(0.1):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"peer process did not start (exit code {self.proc.exitcode})")
        self.info: dict[str, Any] = self.conn.recv()
        self.kv = cpu_backend_kv_caches(seed=spec.seed, **spec.kv_kwargs())  # what the peer holds (on CPU)

    def layer(self, layer: int) -> torch.Tensor:
        return self.kv[LAYER_NAME.format(layer)]

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send("stop")
                self.conn.poll(10)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def kill9(self) -> None:
        os.kill(self.info["pid"], signal.SIGKILL)
        self.proc.join(10)


class Reader:
    def __init__(self, name: str, spec: PeerSpec) -> None:
        from kvbroker.engine_adapter.block_mover import BlockMover
        from kvbroker.engine_adapter.cpu_tier import CpuTierBuffer
        from kvbroker.engine_adapter.kv_regions import regions_from_kv_caches

        self.kv = cpu_backend_kv_caches(seed=None, device=spec.device, **spec.kv_kwargs())
        regions, n, mem = regions_from_kv_caches(self.kv)
        self.mover = BlockMover(name, read_timeout_s=30)
        self.mover.register_tier(GPU, mem, regions, n)
        self.tier = CpuTierBuffer(regions, spec.num_slots)
        self.mover.register_tier(CPU, self.tier.mem_type, self.tier.regions(), self.tier.num_slots)

    def layer(self, layer: int) -> torch.Tensor:
        return self.kv[LAYER_NAME.format(layer)]

    def wait(self, handles: list[int], timeout: float = 20.0) -> tuple[list[int], dict[int, str]]:
        done: list[int] = []
        failed: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(done) + len(failed) < len(handles):
            d, f = self.mover.poll()
            done += d
            failed |= f
            time.sleep(0.0005)
        assert len(done) + len(failed) == len(handles), "reads neither finished nor failed (hang)"
        return done, failed

    def close(self) -> None:
        self.mover.close()
        self.tier.close()
