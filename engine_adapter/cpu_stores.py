"""The CPU offload tier on the scheduler side: stores to it, and pins of it for readers.

When a request finishes normally, its full blocks not already on the tier get
slots in the directory (engine_adapter/cpu_directory.py) and a StoreSpec tells
the worker to copy them; vLLM keeps the blocks (delay_free) until every rank
reports the copy done. Only then are they announced to the broker as tier CPU
(a failed copy frees its slots, unannounced); evictions are announced removed.
A reader's lease on tier CPU makes the broker send a PinCommand, answered on
the session thread by pinning the slots for that lease until it ends. Restores
from this engine's own tier are loads (engine_adapter/loads.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbroker.engine_adapter.cpu_directory import BlockKey
from kvbroker.engine_adapter.decisions import holdable_blocks, wire_hashes
from kvbroker.engine_adapter.metadata import ReadOutcomes, StoreSpec
from kvbroker.engine_adapter.scheduler_context import SchedulerContext, finished_normally
from kvbroker.v1 import broker_pb2 as pb

# Under "vllm." so that vLLM's logging configuration prints our lines.
logger = logging.getLogger("vllm.kvbroker.scheduler")


@dataclass
class Store:
    """A GPU -> CPU tier copy in flight (one per finished request)."""

    request_id: str
    slots: list[int]
    ranks_done: int = 0
    failure: str = ""


class CpuStores:
    def __init__(self, ctx: SchedulerContext) -> None:
        self._ctx = ctx
        self._stores: dict[int, Store] = {}
        self._next_store_id = 1
        self._pending_specs: list[StoreSpec] = []

    def store_finished(self, request: Any, block_ids: Sequence[int], *, free_after_copy: bool) -> bool:
        """Copy the request's full blocks (prefix hits included) to the CPU tier; True if a copy started.

        vLLM keeps the blocks (delay_free) until the copy is done: the worker
        reports the request freed only then, so no new request overwrites
        them mid-copy.
        """
        ctx = self._ctx
        cpu = ctx.cpu
        assert cpu is not None
        link = ctx.link
        if not finished_normally(request) or link is None or not link.layout_id:
            return False
        n = holdable_blocks(
            request.num_computed_tokens, len(request.block_hashes), len(block_ids), ctx.block_size
        )
        if n == 0:
            return False
        namespace = ctx.namespace(request)
        keys = [(namespace.layout_id, namespace.tenant, h) for h in wire_hashes(request.block_hashes[:n])]
        position = {key: i for i, key in enumerate(keys)}
        allocation = cpu.allocate(keys)
        if allocation.evicted:
            ctx.stats.count("cpu_evicted_blocks", len(allocation.evicted))
            self._announce(allocation.evicted, stored=False)
        ctx.stats.count("cpu_store_skipped_present", allocation.skipped_present)
        ctx.stats.count("cpu_store_no_room", allocation.no_room)
        if not allocation.assigned:
            return False
        store_id = self._next_store_id
        self._next_store_id += 1
        slots = [slot for _, slot in allocation.assigned]
        gpu_ids = [int(block_ids[position[key]]) for key, _ in allocation.assigned]
        self._stores[store_id] = Store(request.request_id, slots)
        self._pending_specs.append(StoreSpec(store_id, request.request_id, tuple(gpu_ids), tuple(slots)))
        if free_after_copy:
            # The worker reports the request freed once its copy is done.
            ctx.pending_frees.append(request.request_id)
        ctx.stats.count("cpu_stores")
        return True

    def on_outcomes(self, outcomes: ReadOutcomes) -> None:
        """The worker ranks' copy results; a copy is done when every rank reported."""
        for store_id, reason in outcomes.stores_failed.items():
            store = self._stores.get(store_id)
            if store is not None and not store.failure:
                store.failure = reason
        for store_id, count in outcomes.stores_done.items():
            store = self._stores.get(store_id)
            if store is None:
                continue
            store.ranks_done += count
            if store.ranks_done >= self._ctx.expected_ranks:
                self._finish(store_id)

    def take_specs(self) -> list[StoreSpec]:
        specs, self._pending_specs = self._pending_specs, []
        return specs

    def pin(self, command: pb.PinCommand) -> pb.PinResult:
        """Broker PinCommand (session thread): pin CPU-tier slots for a reader's lease."""
        cpu = self._ctx.cpu
        lease = command.lease
        if lease.tier != pb.TIER_CPU or cpu is None:
            return pb.PinResult(
                lease_id=lease.lease_id, ok=False, error="pinning unheld GPU blocks is not supported"
            )
        ns = lease.namespace
        keys = [(ns.layout_id, ns.tenant, int(h)) for h in lease.block_hashes]
        slots = cpu.pin(lease.lease_id, keys)
        self._ctx.stats.count("cpu_pins" if slots is not None else "cpu_pins_refused")
        if slots is None:
            return pb.PinResult(
                lease_id=lease.lease_id, ok=False, error="blocks are not (or no longer) on the CPU tier"
            )
        self._ctx.state_digests(pb.TIER_CPU, slots, lease.block_hashes)
        logger.info(
            "kvbroker: pinned %d CPU-tier blocks for lease %s (reader %s)",
            len(slots),
            lease.lease_id,
            lease.reader_engine_id or "none: a retention",
        )
        return pb.PinResult(lease_id=lease.lease_id, ok=True, block_ids=slots)

    def unpin(self, lease_id: str) -> None:
        """A lease ended (session thread): its CPU-tier slots may be evicted again."""
        if self._ctx.cpu is not None:
            self._ctx.cpu.unpin(lease_id)

    def _finish(self, store_id: int) -> None:
        cpu = self._ctx.cpu
        assert cpu is not None
        store = self._stores.pop(store_id)
        if store.failure:
            cpu.discard(store.slots)
            self._ctx.stats.count("cpu_stores_failed")
            logger.warning(
                "kvbroker: request %s: copy of %d blocks to the CPU tier failed: %s",
                store.request_id,
                len(store.slots),
                store.failure,
            )
        else:
            ready = cpu.mark_ready(store.slots)
            self._ctx.stats.count("cpu_stored_blocks", len(ready))
            self._announce(ready, stored=True)
            logger.debug("kvbroker: request %s: %d blocks on the CPU tier", store.request_id, len(ready))

    def _announce(self, keys: Sequence[BlockKey], *, stored: bool) -> None:
        link = self._ctx.link
        if link is None:
            return
        by_namespace: dict[tuple[str, str], list[int]] = {}
        for layout_id, tenant, h in keys:
            by_namespace.setdefault((layout_id, tenant), []).append(h)
        for (layout_id, tenant), hashes in by_namespace.items():
            namespace = pb.Namespace(layout_id=layout_id, tenant=tenant)
            if stored:
                link.announce_stored(namespace, hashes, pb.TIER_CPU)
            else:
                link.announce_removed(namespace, hashes, pb.TIER_CPU)
