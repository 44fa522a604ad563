"""The fixed control-plane workloads: their sizes and what every measurement shares.

One function per system, each returning a JSON-ready dict: the peers (grpc floors,
Redis, Mooncake) in bench.control_plane.measure_peers, our broker in bench.control_plane.measure_broker (with
its inventory and mirror figures in bench.control_plane.measure_inventory and bench.control_plane.measure_mirror).

Workload: namespaces of 64-block chains of random 64-bit hashes. A lookup asks for
the longest held prefix of one chain (every lookup chain is fully held, and each
answer is checked to be 64 before timing starts). Publishing announces a fresh
chain of 64 blocks. Latency is closed-loop (see bench.harness.loops) at 1 and 16
concurrent clients, repeated ``reps`` times.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

# The echo floors' methods (bench.control_plane.grpc_echo serves them, measure_peers calls them).
UNARY_METHOD = "/bench.Echo/Unary"
STREAM_METHOD = "/bench.Echo/Stream"

T = TypeVar("T")


@dataclass
class Settings:
    """Sizes of one benchmark run; ``quick()`` and ``tiny()`` shrink them."""

    reps: int = 5
    warmup: int = 50
    ops_1: int = 2000  # measured ops of the single client, per repetition
    ops_16: int = 300  # measured ops per client with 16 clients, per repetition
    concurrency: tuple[int, ...] = (1, 16)
    lookup_chains: int = 256
    publish_ops_1: int = 300  # chains published by the single client, per repetition
    publish_ops_16: int = 60  # chains published per client with 16 clients
    engines: int = 1000
    session_channels: int = 8
    broker_mem_blocks: tuple[int, ...] = (1_000_000, 10_000_000)
    broker_load_batch: int = 8192
    redis_mem_keys: int = 1_000_000
    mooncake_mem_keys: int = 100_000
    mirror_lag_samples: int = 300
    ttl_ms: int = 600_000
    broker_args: list[str] = field(default_factory=list)

    @classmethod
    def quick(cls) -> Settings:
        return cls(
            reps=3,
            warmup=30,
            ops_1=600,
            ops_16=80,
            publish_ops_1=100,
            publish_ops_16=20,
            engines=1000,
            broker_mem_blocks=(200_000, 1_000_000),
            redis_mem_keys=100_000,
            mooncake_mem_keys=10_000,
        )

    @classmethod
    def tiny(cls) -> Settings:
        """Smoke-test sizes: proves the programs work, measures nothing worth keeping."""
        return cls(
            reps=1,
            warmup=3,
            ops_1=30,
            ops_16=5,
            concurrency=(1, 4),
            lookup_chains=16,
            publish_ops_1=5,
            publish_ops_16=2,
            engines=20,
            session_channels=2,
            broker_mem_blocks=(5_000, 20_000),
            broker_load_batch=2048,
            redis_mem_keys=2_000,
            mooncake_mem_keys=500,
        )

    def ops_for(self, clients: int) -> int:
        return self.ops_1 if clients == 1 else self.ops_16

    def publish_ops_for(self, clients: int) -> int:
        return self.publish_ops_1 if clients == 1 else self.publish_ops_16


def run_async(coro_fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run on uvloop when installed (the broker runs on it), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro_fn())
    return uvloop.run(coro_fn())


def lookup_namespaces(n_chains: int) -> list[str]:
    return [f"t{i % 4}" for i in range(n_chains)]
