"""The CPU offload tier: a host buffer with the KV cache's per-layer block geometry.

Each region of the KV cache (one per layer, or two for K/V-split layouts) gets
`num_slots` slots of the same `block_bytes`, stored region-major so that
consecutive slots of a layer are adjacent bytes (NIXL merges them into one
descriptor when a peer reads a run of slots). The buffer is pinned under CUDA
so copies to and from VRAM are asynchronous DMA.

Copies never block the caller: on CUDA they are queued on a side stream and
finish when their event fires; on CPU (where the "GPU" tier is host memory)
a single background thread does them (torch releases the GIL while copying).
Slot allocation, LRU and pins are the scheduler's business, not this module's.

Register the buffer with NIXL so remote readers can pull from it:
`mover.register_tier(TIER_CPU, tier.mem_type, tier.regions(), tier.num_slots)`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import count
from typing import Any

import torch

from kvbroker.engine_adapter.kv_regions import Region

log = logging.getLogger(__name__)


@dataclass
class _Copy:
    future: Future[None] | None = None  # CPU path
    event: Any = None  # CUDA path: torch.cuda.Event


class CpuTierBuffer:
    """Host slots shaped like the KV cache's blocks; asynchronous store (KV -> slots) and load."""

    mem_type = "DRAM"

    def __init__(self, regions_like: list[Region], num_slots: int, pin_memory: bool | None = None) -> None:
        if num_slots <= 0 or not regions_like:
            raise ValueError("the CPU tier needs at least one region and one slot")
        self.num_slots = num_slots
        self._source = list(regions_like)
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        total = sum(r.block_bytes for r in regions_like) * num_slots
        self._buf = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        self.pinned = pin
        self._slots: list[torch.Tensor] = []  # per region: [num_slots, block_bytes] view
        self._regions: list[Region] = []
        offset = 0
        for r in regions_like:
            view = self._buf[offset : offset + r.block_bytes * num_slots].view(num_slots, r.block_bytes)
            self._slots.append(view)
            self._regions.append(Region(r.layer, view.data_ptr(), r.block_bytes, r.block_bytes, 0))
            offset += r.block_bytes * num_slots
        self._copies: dict[int, _Copy] = {}
        self._failed: dict[int, str] = {}
        self._handles = count(1)
        self._executor: ThreadPoolExecutor | None = None
        self._stream: Any = None
        self._source_views: dict[tuple[int, ...], list[torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return self._buf.numel()

    def regions(self) -> list[Region]:
        """The slots as regions (block id = slot id), in the same order as `regions_like`."""
        return list(self._regions)

    def slot_bytes(self, region_index: int, slot: int) -> torch.Tensor:
        """The bytes of one slot of one region (a view, for inspection and tests)."""
        return self._slots[region_index][slot]

    def start_store(
        self, kv_caches: dict[str, torch.Tensor], gpu_block_ids: Sequence[int], slot_ids: Sequence[int]
    ) -> int:
        """Copy KV blocks `gpu_block_ids[i]` of every region into slots `slot_ids[i]`."""
        kv_views = self._kv_views(kv_caches)
        runs = [(slot, block, n) for block, slot, n in self._pairs(kv_views, gpu_block_ids, slot_ids)]
        return self._submit([(self._slots[i], kv_views[i], runs) for i in range(len(self._slots))])

    def start_load(
        self, slot_ids: Sequence[int], kv_caches: dict[str, torch.Tensor], gpu_block_ids: Sequence[int]
    ) -> int:
        """Copy slots `slot_ids[i]` back into KV blocks `gpu_block_ids[i]` of every region."""
        kv_views = self._kv_views(kv_caches)
        runs = self._pairs(kv_views, gpu_block_ids, slot_ids)
        return self._submit([(kv_views[i], self._slots[i], runs) for i in range(len(self._slots))])

    def poll(self) -> list[int]:
        """Handles whose copies have finished (failed ones are in `take_failed()`)."""
        done = []
        for handle, copy in list(self._copies.items()):
            if copy.future is not None and copy.future.done():
                exc = copy.future.exception()
                if exc is not None:
                    log.error("CPU tier copy %d failed: %s", handle, exc)
                    self._failed[handle] = f"{type(exc).__name__}: {exc}"
                else:
                    done.append(handle)
                del self._copies[handle]
            elif copy.event is not None and copy.event.query():
                done.append(handle)
                del self._copies[handle]
        return done

    def take_failed(self) -> dict[int, str]:
        out, self._failed = self._failed, {}
        return out

    def wait(self, handle: int) -> None:
        """Block until one copy finished (for shutdown and tests; the engine uses poll())."""
        copy = self._copies.get(handle)
        if copy is None:
            return
        if copy.future is not None:
            copy.future.exception()
        else:
            copy.event.synchronize()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------ internals

    def _pairs(
        self, kv_views: list[torch.Tensor], gpu_block_ids: Sequence[int], slot_ids: Sequence[int]
    ) -> list[tuple[int, int, int]]:
        """Validate ids and coalesce them into runs (kv block, slot, length) contiguous on both sides."""
        blocks = [int(b) for b in gpu_block_ids]
        slots = [int(s) for s in slot_ids]
        if len(blocks) != len(slots):
            raise ValueError(f"{len(blocks)} KV blocks but {len(slots)} slots")
        kv_blocks = min(v.shape[0] for v in kv_views)
        for b in blocks:
            if not 0 <= b < kv_blocks:
                raise ValueError(f"KV block {b} out of range [0, {kv_blocks})")
        for s in slots:
            if not 0 <= s < self.num_slots:
                raise ValueError(f"slot {s} out of range [0, {self.num_slots})")
        runs: list[tuple[int, int, int]] = []
        for b, s in zip(blocks, slots, strict=True):
            if runs and runs[-1][0] + runs[-1][2] == b and runs[-1][1] + runs[-1][2] == s:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((b, s, 1))
        return runs

    def _submit(self, jobs: list[tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]]) -> int:
        """Each job is (dst, src, runs); a run (d, s, n) copies src[s:s+n] into dst[d:d+n]."""
        handle = next(self._handles)
        on_cuda = any(t.is_cuda for dst, src, _ in jobs for t in (dst, src))
        if on_cuda:
            device = next(t.device for dst, src, _ in jobs for t in (dst, src) if t.is_cuda)
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=device)
            # The copy must see every KV write the model already queued.
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                _run_copies(jobs, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._copies[handle] = _Copy(event=event)
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-tier-copy")
            self._copies[handle] = _Copy(future=self._executor.submit(_run_copies, jobs, False))
        return handle

    def _kv_views(self, kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """[blocks, block_bytes] byte views of the KV cache, one per region of `regions_like`.

        Regions are found by address inside the storages of `kv_caches`, so
        any layout regions_from_kv_caches accepts works here too.
        """
        key = tuple(sorted(t.untyped_storage().data_ptr() for t in kv_caches.values()))
        cached = self._source_views.get(key)
        if cached is not None:
            return cached
        storages: dict[int, torch.Tensor] = {}
        for t in kv_caches.values():
            st = t.untyped_storage()
            if st.data_ptr() not in storages:
                flat = torch.empty(0, dtype=torch.uint8, device=t.device)
                flat.set_(st, 0, (st.nbytes(),), (1,))
                storages[st.data_ptr()] = flat
        views = []
        for r in self._source:
            home = next(
                (f for start, f in storages.items() if start <= r.base_addr < start + f.numel()),
                None,
            )
            if home is None:
                raise ValueError(
                    f"region of layer {r.layer} at {r.base_addr:#x} is not in the given KV caches"
                )
            offset = r.base_addr - home.data_ptr()
            blocks = (home.numel() - offset - r.block_bytes) // r.block_stride + 1
            views.append(home.as_strided((blocks, r.block_bytes), (r.block_stride, 1), offset))
        self._source_views[key] = views
        return views


def _run_copies(
    jobs: list[tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]], non_blocking: bool
) -> None:
    # vLLM creates the KV cache as inference tensors: writing into them (a copy back
    # from the tier) is allowed only in inference mode, which this thread is not in.
    with torch.inference_mode():
        for dst, src, runs in jobs:
            for dst_start, src_start, n in runs:
                dst[dst_start : dst_start + n].copy_(
                    src[src_start : src_start + n], non_blocking=non_blocking
                )
