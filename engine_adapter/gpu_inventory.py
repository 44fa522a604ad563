"""What this engine's GPU tier really caches, told to the broker; pins of it for readers.

The broker names an engine for a block as long as the block is in vLLM's
prefix cache, not only while a hold covers it, so routing keeps a
conversation for as long as its engine does. Two sources keep a block
announced (``GpuInventory`` counts both, per namespace and hash, and
announces a change only when the first source appears or the last one goes):

- **cached**: vLLM's block pool has the block under that hash. A finished
  request's full computed blocks are checked against the pool
  (``blocks[id].block_hash``) and added; vLLM's own KV cache events
  (``BlockRemoved`` and ``AllBlocksCleared`` in the bound pool's event queue,
  read just before vLLM's scheduler drains it) remove them. A hash that
  another block still caches stays.
- **held**: a hold (holds.py) keeps the blocks for a reader; without a bound
  pool this is the only source.

A reader's lease on cached blocks that no hold covers makes the broker send
a PinCommand. The session thread queues it (``pin`` returns a Future) and
wakes vLLM's engine loop; the scheduler thread, the only one that may touch
the pool, takes a reference on the blocks (``serve``) and answers. The lease's
end drops the reference the same way.

Announcements go to the session, which coalesces them into few messages on
its stream (clients/inventory.py): a finished request costs one dict lookup
per block here.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvbroker.engine_adapter.cpu_directory import BlockKey
from kvbroker.engine_adapter.scheduler_context import SchedulerContext
from kvbroker.v1 import broker_pb2 as pb

logger = logging.getLogger("vllm.kvbroker.scheduler")

# The one KV cache group whose blocks are announced (models with one attention type).
GROUP = 0


class GpuInventory:
    def __init__(self, ctx: SchedulerContext, wake: Callable[[], None] | None = None) -> None:
        self._ctx = ctx
        # Makes vLLM's engine loop step once more (engine_adapter/wakeup.py); None: wait for a step.
        self.wake = wake
        self._held: Counter[BlockKey] = Counter()
        # key -> vLLM's BlockHashWithGroupId of the cached block; and vLLM's event form -> key.
        self._cached: dict[BlockKey, Any] = {}
        self._by_event: dict[Any, BlockKey] = {}
        self._pool: Any = None
        self._event_queue: list[Any] | None = None
        self._events_seen = 0
        # Pins and unpins from the session thread, in order, for the scheduler thread.
        self._requests_lock = threading.Lock()
        self._requests: list[tuple[pb.PinCommand | None, str, Future[pb.PinResult] | None]] = []
        self._pinned: dict[str, list[Any]] = {}
        # Blocks pinned for retentions (a lease with no reader), by lease: bounded by retain_gpu_fraction.
        self._retained: dict[str, int] = {}

    # ------------------------------------------------------------------
    # vLLM's block pool
    # ------------------------------------------------------------------

    def bind(self, pool: Any) -> None:
        """Read removals from vLLM's KV cache events: turn them on in the pool if nobody did."""
        from vllm.v1.core import kv_cache_utils as utils

        self._utils = utils
        self._pool = pool
        # vLLM's scheduler drains and publishes the queue every step (to its null
        # publisher when no kv_events_config asked for events).
        pool.enable_kv_cache_events = True

    @property
    def bound(self) -> bool:
        return self._pool is not None

    def cached_from_request(
        self, namespace: pb.Namespace, block_hashes: Sequence[Any], block_ids: Sequence[int]
    ) -> int:
        """A finished request's full blocks, those the pool caches under their hash; returns how many are new."""
        pool = self._pool
        if pool is None:
            return 0
        utils = self._utils
        changed: list[int] = []
        for h, block_id in zip(block_hashes, block_ids, strict=False):
            pool_hash = pool.blocks[block_id].block_hash
            if (
                pool_hash is None
                or utils.get_block_hash(pool_hash) != h
                or utils.get_group_id(pool_hash) != GROUP
            ):
                continue
            key = (namespace.layout_id, namespace.tenant, int.from_bytes(bytes(h)[:8], "big"))
            if key in self._cached:
                continue
            self._cached[key] = pool_hash
            self._by_event[utils.maybe_convert_block_hash(h)] = key
            if not self._held.get(key):
                changed.append(key[2])
        if changed:
            self._ctx.stats.count("gpu_announced_blocks", len(changed))
            self._announce(namespace, changed, stored=True)
        return len(changed)

    def read_events(self) -> None:
        """Evictions since the last look (scheduler thread), read where vLLM will drain them."""
        pool = self._pool
        if pool is None:
            return
        queue = pool.kv_event_queue
        if queue is not self._event_queue:
            self._event_queue, self._events_seen = queue, 0
        if self._events_seen >= len(queue):
            return
        events, self._events_seen = queue[self._events_seen :], len(queue)
        gone: list[BlockKey] = []
        for event in events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                gone.extend(self._cached)
            elif kind == "BlockRemoved" and getattr(event, "group_idx", None) in (None, GROUP):
                gone.extend(k for k in map(self._by_event.get, event.block_hashes) if k is not None)
        self._evict(gone)

    def _evict(self, keys: list[BlockKey]) -> None:
        pool = self._pool
        removed: dict[tuple[str, str], list[int]] = {}
        for key in keys:
            pool_hash = self._cached.get(key)
            if pool_hash is None:
                continue
            if pool.cached_block_hash_to_block.get_one_block(pool_hash) is not None:
                continue  # another block still caches this hash
            del self._cached[key]
            self._by_event.pop(
                self._utils.maybe_convert_block_hash(self._utils.get_block_hash(pool_hash)), None
            )
            if not self._held.get(key):
                removed.setdefault((key[0], key[1]), []).append(key[2])
        for (layout_id, tenant), hashes in removed.items():
            self._ctx.stats.count("gpu_evicted_blocks", len(hashes))
            self._announce(pb.Namespace(layout_id=layout_id, tenant=tenant), hashes, stored=False)

    # ------------------------------------------------------------------
    # holds (holds.py)
    # ------------------------------------------------------------------

    def held(self, namespace: pb.Namespace, hashes: Sequence[int], *, stored: bool) -> None:
        """A hold started (stored) or ended: announce what no other source covers."""
        changed: list[int] = []
        for h in hashes:
            key = (namespace.layout_id, namespace.tenant, h)
            if stored:
                self._held[key] += 1
                if self._held[key] == 1 and key not in self._cached:
                    changed.append(h)
            else:
                self._held[key] -= 1
                if self._held[key] <= 0:
                    del self._held[key]
                    if key not in self._cached:
                        changed.append(h)
        if changed:
            self._announce(namespace, changed, stored=stored)

    def _announce(self, namespace: pb.Namespace, hashes: list[int], *, stored: bool) -> None:
        link = self._ctx.link
        if link is None:
            return
        if stored:
            link.announce_stored(namespace, hashes)
        else:
            link.announce_removed(namespace, hashes)

    # ------------------------------------------------------------------
    # pins of cached blocks for readers
    # ------------------------------------------------------------------

    def pin(self, command: pb.PinCommand) -> Future[pb.PinResult]:
        """Session thread: answered on the scheduler thread's next step (``serve``), which this wakes."""
        future: Future[pb.PinResult] = Future()
        with self._requests_lock:
            self._requests.append((command, command.lease.lease_id, future))
        self.wake_engine()
        return future

    def unpin(self, lease_id: str) -> None:
        """Session thread: a lease ended; if it pinned blocks here, they go back at the next step."""
        with self._requests_lock:
            self._requests.append((None, lease_id, None))
            pinned = lease_id in self._pinned or any(c is not None for c, _, _ in self._requests)
        if pinned:
            self.wake_engine()

    def has_work(self) -> bool:
        with self._requests_lock:
            return any(c is not None or lease_id in self._pinned for c, lease_id, _ in self._requests)

    def serve(self) -> None:
        """Scheduler thread: answer queued pins and return the blocks of ended leases, in order."""
        with self._requests_lock:
            requests, self._requests = self._requests, []
        pool = self._pool
        for command, lease_id, future in requests:
            if command is None:
                blocks = self._pinned.pop(lease_id, None)
                self._retained.pop(lease_id, None)
                if blocks is not None:
                    pool.free_blocks(reversed(blocks))
                continue
            assert future is not None
            result = self._pin_now(command)
            self._ctx.stats.count("gpu_pins" if result.ok else "gpu_pins_refused")
            if result.ok:  # this step's metadata carries them to the workers (verify_bytes)
                self._ctx.state_digests(pb.TIER_GPU, result.block_ids, command.lease.block_hashes)
            future.set_result(result)

    def unpin_all(self) -> None:
        """The broker session is over, and every lease with it: refuse waiting pins, and give
        every pinned block back at the next step. (Under the scheduler's lock, on any thread.)"""
        self.refuse_waiting_pins()
        with self._requests_lock:
            self._requests.extend((None, lease_id, None) for lease_id in self._pinned)
        self.wake_engine()

    def refuse_waiting_pins(self) -> None:
        """The session's stream broke: pins not made yet are refused (their answer has no stream
        to go to); pins already made stay while the session may resume elsewhere."""
        with self._requests_lock:
            waiting = [(c, f) for c, _, f in self._requests if c is not None and f is not None]
            self._requests = [r for r in self._requests if r[0] is None]
        for command, future in waiting:
            future.set_result(pb.PinResult(lease_id=command.lease.lease_id, ok=False, error="session lost"))

    def _pin_now(self, command: pb.PinCommand) -> pb.PinResult:
        lease = command.lease
        refused = pb.PinResult(lease_id=lease.lease_id, ok=False, error="blocks are no longer cached on GPU")
        pool = self._pool
        if pool is None or lease.lease_id in self._pinned:
            return refused
        ns = lease.namespace
        blocks: list[Any] = []
        for h in lease.block_hashes:
            pool_hash = self._cached.get((ns.layout_id, ns.tenant, int(h)))
            block = (
                pool.cached_block_hash_to_block.get_one_block(pool_hash) if pool_hash is not None else None
            )
            if block is None:
                return refused
            blocks.append(block)
        if not lease.reader_engine_id:  # a retention (broker/retention.py): a bounded share of the pool
            share = self._ctx.config.retain_gpu_fraction
            budget = int(share * pool.num_gpu_blocks)
            kept = sum(self._retained.values())
            if kept + len(blocks) > budget:
                return pb.PinResult(
                    lease_id=lease.lease_id,
                    ok=False,
                    error=f"retentions would pin {kept + len(blocks)} of this engine's {pool.num_gpu_blocks} GPU "
                    f"blocks, over its retain_gpu_fraction {share:g} ({budget} blocks); a CPU tier keeps them there",
                )
            self._retained[lease.lease_id] = len(blocks)
        pool.touch(blocks)
        self._pinned[lease.lease_id] = blocks
        logger.info(
            "kvbroker: pinned %d cached GPU blocks for lease %s (reader %s)",
            len(blocks),
            lease.lease_id,
            lease.reader_engine_id or "none: a retention",
        )
        return pb.PinResult(lease_id=lease.lease_id, ok=True, block_ids=[b.block_id for b in blocks])

    def give_up_retentions(self, free_wanted: int, why: str) -> list[str]:
        """Scheduler thread: give retention pins back to vLLM's pool, least recently retained first,
        until the pool has `free_wanted` free blocks or no retention is left; the broker is told
        (it ends each lease as memory_pressure). Readers' pins are never given up. Returns the
        lease ids given up."""
        pool = self._pool
        given: list[str] = []
        if pool is None:
            return given
        for lease_id in list(self._retained):  # dict order: the order they were pinned
            free = pool.get_num_free_blocks()
            if free >= free_wanted:
                break
            del self._retained[lease_id]
            blocks = self._pinned.pop(lease_id)
            pool.free_blocks(reversed(blocks))  # still cached: vLLM evicts them when it needs to
            given.append(lease_id)
            self._ctx.stats.count("gpu_retentions_given_up")
            self._ctx.stats.count("gpu_retained_blocks_given_up", len(blocks))
            logger.info(
                "kvbroker: gave up retention %s (%d GPU blocks): %s (%d free of %d wanted)",
                lease_id,
                len(blocks),
                why,
                free,
                free_wanted,
            )
            if self._ctx.link is not None:
                self._ctx.link.give_up_pin(lease_id, f"{why} ({free} free blocks, {free_wanted} wanted)")
        return given

    @property
    def retained_leases(self) -> int:
        return len(self._retained)

    def free_and_total(self) -> tuple[int, int]:
        """vLLM's free KV blocks (cached ones with no reference count as free) and all of them."""
        pool = self._pool
        return (pool.get_num_free_blocks(), pool.num_gpu_blocks) if pool is not None else (0, 0)

    def wake_engine(self) -> None:
        """Make vLLM's engine loop step once more, if it sleeps (any thread)."""
        if self.wake is not None:
            self.wake()
