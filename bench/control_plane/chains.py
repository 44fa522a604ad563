"""The control-plane workload's chains: random 64-bit block hashes, 64 to a chain."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

CHAIN_LEN = 64
# The least a published block moves: its 64-bit hash (fixed64 on the wire).
BLOCK_WIRE_BYTES = 8


def random_hashes(rng: random.Random, n: int) -> list[int]:
    """n random 64-bit block hashes (the wire form of vLLM's chained hashes)."""
    return [rng.getrandbits(64) for _ in range(n)]


def make_chains(n_chains: int, seed: int, length: int = CHAIN_LEN) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_hashes(rng, length) for _ in range(n_chains)]


def longest_prefix(found: Sequence[Any]) -> int:
    """Length of the leading run of truthy entries (the matched prefix of a chain)."""
    for i, x in enumerate(found):
        if not x:
            return i
    return len(found)
