"""When vLLM needs GPU memory, retentions give it back: the pins are given up, not held to their TTL.

A retention (broker/retention.py) pins a conversation's cached GPU blocks with
no reader, so that vLLM does not evict them. That is worth it only while the
memory is not needed to run requests: an engine without a CPU tier that kept
the pins for the whole TTL would stall a request whose prompt needs more free
blocks than the pins leave (vLLM cannot preempt a pin). Two signals, both read
on the scheduler thread, where the pool may be touched:

- a waiting request (``get_num_new_matched_tokens``, just before vLLM tries to
  allocate for it) needs its prompt's blocks beyond its local prefix hit: the
  pool should have that many free, plus the low-water share;
- at every step, free blocks below the low-water share
  (``retain_gpu_low_water`` of the cache): running requests are about to need
  them.

Then retention pins are given back, least recently retained first, until
enough blocks are free (GpuInventory.give_up_retentions). The blocks stay in
vLLM's prefix cache (a freed block with a hash is evictable, not erased), so a
conversation may still be served from it if nothing else needed them; the
broker ends each lease as ``memory_pressure`` and its Retain caller learns it on
renewal and on Watch. A CPU-tier copy's pin is never given up here: it costs
no GPU memory.
"""

from __future__ import annotations

import math
from typing import Any

from kvbroker.engine_adapter.gpu_inventory import GpuInventory


def blocks_to_compute(request: Any, num_computed_tokens: int, block_size: int) -> int:
    """KV blocks a waiting request still needs before its first token: its prompt beyond its
    local prefix hit (vLLM allocates them in one or, with chunked prefill, several steps)."""
    return max(0, math.ceil(request.num_tokens / block_size) - num_computed_tokens // block_size)


class RetentionPressure:
    def __init__(self, gpu: GpuInventory, low_water: float, block_size: int) -> None:
        self._gpu = gpu
        self._low_water = low_water
        self._block_size = block_size

    def _low_water_blocks(self, total: int) -> int:
        return math.ceil(self._low_water * total)

    def on_waiting(self, request: Any, num_computed_tokens: int) -> list[str]:
        """A waiting request is about to be allocated: make room for it if retentions take it."""
        if not self._gpu.retained_leases:
            return []
        free, total = self._gpu.free_and_total()
        wanted = blocks_to_compute(request, num_computed_tokens, self._block_size)
        wanted += self._low_water_blocks(total)
        if free >= wanted:
            return []
        return self._gpu.give_up_retentions(
            wanted, f"waiting request {request.request_id} needs {wanted} GPU blocks"
        )

    def on_step(self) -> list[str]:
        """Every step: free blocks below the low-water share give retentions up."""
        if not self._gpu.retained_leases or not self._low_water:
            return []
        free, total = self._gpu.free_and_total()
        wanted = self._low_water_blocks(total)
        if free >= wanted:
            return []
        return self._gpu.give_up_retentions(
            wanted, f"free GPU blocks below the low-water mark {self._low_water:g}"
        )
