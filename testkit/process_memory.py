"""Reading and writing another process's memory through /proc/PID/mem, for fault injection.

An end-to-end test corrupts the KV bytes a real engine holds for a reader, to see the reader's
verification catch it (tests/e2e/test_adapter_e2e.py). Linux lets a process read and write the
memory of its descendants (same user) this way; the addresses come from what the engine
registered with the broker (its ranks' memory regions).
"""

from __future__ import annotations

from collections.abc import Iterable

import psutil

from kvbroker.engine_adapter.digests import stamp_of
from kvbroker.engine_adapter.multilinear import digest_words
from kvbroker.v1 import broker_pb2 as pb


def read(pid: int, addr: int, length: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(addr)
        return mem.read(length)


def write(pid: int, addr: int, data: bytes) -> None:
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(addr)
        mem.write(data)


def descendants(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def stated_block(pids: Iterable[int], tier: pb.TierInfo, block_id: int, block_hash: int) -> int | None:
    """The process (of `pids`) whose digest table states `block_id` of `tier` for `block_hash`,
    and whose bytes of that block (first layer) have the stated digest; None if none does yet."""
    digests, region = tier.digest_table.regions[0], tier.regions[0]
    for pid in pids:
        try:
            entry = int.from_bytes(
                read(pid, digests.base_addr + block_id * digests.block_stride, 8), "little"
            )
            block = read(pid, region.base_addr + block_id * region.block_stride, region.block_bytes)
        except OSError:  # not mapped in this process
            continue
        if entry & 0xFFFFFFFF == stamp_of(block_hash) and entry >> 32 == digest_words(block):
            return pid
    return None
