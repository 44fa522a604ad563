"""bench.scale.replicas's workload chains: the same in the benchmark and in its mirror process."""

from __future__ import annotations

import random

CHAIN = 64


def chains_for(blocks: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.getrandbits(64) for _ in range(CHAIN)] for _ in range(blocks // CHAIN)]
