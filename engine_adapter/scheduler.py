"""Scheduler side of the connector: decide pull vs recompute, take and release
leases, hold finished requests' blocks for readers.

Runs inside vLLM's scheduler loop and never blocks on the broker: every broker
call is a Future, checked again at the next step. A request waits either in
vLLM's "ask again" state (``get_num_new_matched_tokens`` -> None) while its
lookup is pending, or in WAITING_FOR_REMOTE_KVS while its lease is acquired,
its blocks are read and the lease is released. Whatever goes wrong, the
request is handed back to vLLM to recompute, with one log line saying why.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from kvbroker.engine_adapter.broker_link import BrokerLink
from kvbroker.engine_adapter.config import AdapterConfig
from kvbroker.engine_adapter.cpu_directory import BlockKey, CpuDirectory
from kvbroker.engine_adapter.decisions import (
    SKIP_BAD_PARAMS,
    SKIP_ERROR,
    SKIP_INCOMPATIBLE,
    SKIP_NO_BROKER,
    SKIP_TIMEOUT,
    BadTransferParams,
    Decision,
    PullPlan,
    TransferParams,
    decide_pull,
    holdable_blocks,
    parse_transfer_params,
    wire_hashes,
)
from kvbroker.engine_adapter.metadata import (
    AdapterMetadata,
    Commit,
    HolderRank,
    LoadSpec,
    ReadOutcomes,
    RegionSpec,
    StoreSpec,
)
from kvbroker.engine_adapter.stats import SchedulerStats, StatsWriter
from kvbroker.engine_adapter.topology import check_sizes
from kvbroker.engine_adapter.tracing import Span, current, end_span, start_span
from kvbroker.v1 import broker_pb2 as pb

# Under "vllm." so that vLLM's logging configuration prints our lines.
logger = logging.getLogger("vllm.kvbroker.scheduler")

# How often a lookup is re-asked while the router's hint says a holder should
# appear (its hold may reach the broker a moment after its answer reached us).
_HINT_RETRY_S = 0.02
# Pin id prefix of restores from our own CPU tier (no broker lease backs them).
LOCAL_PIN_PREFIX = "local:"

# A wait on the broker counts at most this much of one gap between two checks: a
# longer gap means this process did not run (a stalled host) or ran one long model
# step, and the broker's answer may be waiting unread; that is not the broker's delay.
_MAX_COUNTED_GAP_S = 0.25

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass
class _Budget:
    """How long a wait on the broker may take, counted while this scheduler checks it."""

    limit_s: float
    last: float
    used_s: float = 0.0

    def left(self, now: float) -> float:
        """Seconds left after counting the time since the last check (capped at _MAX_COUNTED_GAP_S)."""
        self.used_s += min(max(0.0, now - self.last), _MAX_COUNTED_GAP_S)
        self.last = now
        return self.limit_s - self.used_s


def _locked(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run under the scheduler's lock: hold state is shared with the session thread."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with args[0]._lock:  # type: ignore[attr-defined]
            return method(*args, **kwargs)

    return wrapper


@dataclass
class _Lookup:
    request_id: str
    params: TransferParams
    namespace: pb.Namespace
    hashes: list[int]
    budget: _Budget
    future: Future[pb.ResolveResponse] | None = None
    last_submit: float = 0.0
    response: pb.ResolveResponse | None = None
    last_response: pb.ResolveResponse | None = None
    num_local_tokens: int = 0
    decision: Decision | None = None
    logged: bool = False
    span: Span | None = None
    answered_by: str = "broker"  # or "mirror": the local index mirror answered at once


@dataclass
class _Load:
    request_id: str
    plan: PullPlan
    namespace: pb.Namespace
    hashes: list[int]
    local_block_ids: tuple[int, ...]
    started: float
    budget: _Budget
    state: str = "acquiring"  # acquiring -> reading -> releasing -> done
    future: Future[Any] | None = None
    lease: pb.Lease | None = None
    ranks_done: int = 0
    failure: str = ""
    bytes_read: int = 0
    aborted: bool = False
    span: Span | None = None
    # Restore from this engine's own CPU tier (no lease): the pin that keeps the slots.
    local_pin: str = ""


class HoldPin(enum.Enum):
    """Who keeps a held request's blocks out of vLLM's free pool."""

    # Our own reference in vLLM's block pool (bind_gpu_block_pool): vLLM frees the
    # request at once, so an engine that only holds has no work and sleeps.
    BLOCK_POOL = "block_pool"
    # vLLM's delay_free_blocks: the request stays in the scheduler until the
    # worker reports it sent. vLLM counts such a request as work and steps
    # without pause, so this is only the fallback when no block pool is bound.
    DELAY_FREE = "delay_free"


@dataclass
class _Held:
    request_id: str
    namespace: pb.Namespace
    hashes: list[int]
    block_ids: list[int]
    started: float
    future: Future[pb.Lease] | None
    pin: HoldPin = HoldPin.DELAY_FREE
    lease_id: str = ""
    freed: bool = False
    announced: bool = False


@dataclass
class _Store:
    """A GPU -> CPU tier copy in flight (one per finished request)."""

    request_id: str
    slots: list[int]
    ranks_done: int = 0
    failure: str = ""


class AdapterScheduler:
    def __init__(
        self,
        *,
        config: AdapterConfig,
        link: BrokerLink | None,
        block_size: int,
        tp_size: int = 1,
        pp_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.link = link
        self.block_size = block_size
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.expected_ranks = tp_size * pp_size
        self._clock = clock
        self._lookups: dict[str, _Lookup] = {}
        # Requests whose load failed: vLLM reschedules them to recompute, and asks us
        # again; they must not try the same load again (it may fail the same way).
        self._failed_loads: set[str] = set()
        self._loads: dict[str, _Load] = {}
        self._held: dict[str, _Held] = {}
        self._held_by_lease: dict[str, str] = {}
        # Requests whose kv_transfer_params name another engine's hold for them:
        # request id -> (holder, the holder's request id). Declined unless pulled from.
        self._named_holds: dict[str, tuple[str, str]] = {}
        self._ended_leases: set[str] = set()
        self._announced: Counter[tuple[str, str, int]] = Counter()
        self._pending_specs: list[LoadSpec] = []
        self._pending_commits: list[Commit] = []
        self._pending_frees: list[str] = []
        self._was_connected = False
        self.stats = SchedulerStats()
        # Writes stats_path on its own thread, from snapshots taken here.
        self._stats_writer = StatsWriter(config.stats_path) if config.stats_path else None
        # CPU offload tier (cpu_tier_blocks > 0): slot directory and copies in flight.
        self.cpu: CpuDirectory | None = None
        self._stores: dict[int, _Store] = {}
        self._next_store_id = 1
        self._pending_stores: list[StoreSpec] = []
        # vLLM's hooks run on the scheduler thread; lease ends, hold replies, pins and
        # connection changes arrive on the session thread, which settles holds itself
        # so that an idle engine (no scheduler steps) still frees at once.
        self._lock = threading.RLock()
        # vLLM's block pool (bind_block_pool) and the held blocks to give back to it.
        # Only the scheduler thread may touch the pool: returns wait for its next hook.
        self._block_pool: Any = None
        self._pool_returns: list[list[int]] = []
        if config.cpu_tier_blocks > 0:
            self.cpu = CpuDirectory(config.cpu_tier_blocks)
            if link is not None:
                link.set_pin_handlers(self.pin_cpu_blocks, self.unpin_cpu_blocks)
        if link is not None:
            link.set_event_listener(self.on_link_event)

    def bind_block_pool(self, block_pool: Any) -> None:
        """vLLM's block pool: holds then keep their blocks with a pool reference (HoldPin.BLOCK_POOL)."""
        self._block_pool = block_pool

    def has_pool_returns(self) -> bool:
        """Ended holds whose blocks still wait for return_held_blocks."""
        return bool(self._pool_returns)

    def return_held_blocks(self) -> bool:
        """Give ended holds' blocks back to vLLM's pool (scheduler thread only); True if any."""
        with self._lock:
            returns, self._pool_returns = self._pool_returns, []
        pool = self._block_pool
        for block_ids in returns:
            # Last block first: vLLM evicts in the order freed, so the prefix outlives its tail.
            pool.free_blocks([pool.blocks[i] for i in reversed(block_ids)])
        return bool(returns)

    @_locked
    def on_link_event(self) -> None:
        """Session thread: a lease ended, a hold was answered, or the connection changed."""
        self._check_connection()
        self._take_lease_ends()
        self._advance_holds(self._clock())
        self._publish_stats()

    # ------------------------------------------------------------------
    # vLLM hooks
    # ------------------------------------------------------------------

    @_locked
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        self.return_held_blocks()
        if req_id in self._failed_loads:
            return 0, False
        lookup = self._lookups.get(req_id)
        now = self._clock()
        if lookup is None:
            lookup = self._start_lookup(request, now)
            if lookup is None:
                return 0, False
        lookup.num_local_tokens = num_computed_tokens
        if lookup.decision is None:
            lookup.decision = self._poll_lookup(lookup, now)
            if lookup.decision is None:
                return None, False
        # Re-decide against the current local hit (it may have grown since).
        decision = lookup.decision
        local_cpu = self._local_cpu_blocks(lookup)
        if lookup.response is not None or local_cpu:
            decision = decide_pull(
                matches=list(lookup.response.matches) if lookup.response is not None else [],
                self_engine_id=self.config.engine_id,
                num_prompt_tokens=request.num_tokens,
                num_local_tokens=num_computed_tokens,
                block_size=self.block_size,
                threshold_tokens=self.config.kv_recompute_threshold,
                preferred_holder=lookup.params.holder_engine_id,
                local_cpu_blocks=local_cpu,
            )
            lookup.decision = decision
        self._log_decision(req_id, lookup, decision)
        if decision.plan is None:
            return 0, False
        return decision.plan.num_tokens, True

    @_locked
    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        lookup = self._lookups.pop(req_id, None)
        named = self._named_holds.pop(req_id, None)
        if req_id in self._loads:
            return
        decision = lookup.decision if lookup is not None and num_external_tokens else None
        plan = decision.plan if decision is not None else None
        if named is not None and (plan is None or plan.holder_engine_id != named[0]):
            self._decline(req_id, named, lookup.decision if lookup is not None else None)
        if lookup is None or plan is None:
            return
        if plan.num_tokens != num_external_tokens:
            # vLLM trimmed the external part (e.g. a local sub-block tail); re-plan the block range.
            first = lookup.num_local_tokens // self.block_size
            end = -(-(lookup.num_local_tokens + num_external_tokens) // self.block_size)
            plan = PullPlan(
                plan.holder_engine_id, plan.tier, plan.hold_lease_id, first, end - first, num_external_tokens
            )
        local_ids = tuple(block_ids[plan.first_block : plan.first_block + plan.num_blocks])
        now = self._clock()
        load = _Load(
            request_id=req_id,
            plan=plan,
            namespace=lookup.namespace,
            hashes=lookup.hashes,
            local_block_ids=local_ids,
            started=now,
            budget=_Budget(self.config.acquire_wait_ms / 1000.0, now),
        )
        self._loads[req_id] = load
        load.span = start_span(
            "kvbroker.pull",
            lookup.params.trace_context,
            {
                "kvbroker.request_id": req_id,
                "kvbroker.blocks": plan.num_blocks,
                "kvbroker.tier": _tier_name(plan.tier),
                "kvbroker.source_engine_id": plan.holder_engine_id,
                "kvbroker.destination_engine_id": self.config.engine_id,
                "kvbroker.hold_lease_id": plan.hold_lease_id,
            },
        )
        if len(local_ids) != plan.num_blocks:
            self._fail_load(load, f"vLLM allocated {len(local_ids)} blocks, expected {plan.num_blocks}")
            return
        if plan.holder_engine_id == self.config.engine_id:
            self._start_local_restore(load)
            return
        link = self.link
        if link is None or not link.connected:
            self._fail_load(load, "broker unreachable when the lease was to be taken")
            return
        if plan.hold_lease_id:
            with current(load.span):
                load.future = link.acquire(plan.hold_lease_id, self.config.lease_ttl_ms)
        else:
            end = plan.first_block + plan.num_blocks
            load.future = link.resolve(
                lookup.namespace,
                lookup.hashes[:end],
                acquire=True,
                lease_ttl_ms=self.config.lease_ttl_ms,
                min_blocks=end,
                request_id=req_id,
            )
        self.stats.count("leases_requested")

    @_locked
    def build_connector_meta(self) -> AdapterMetadata:
        now = self._clock()
        self.return_held_blocks()
        self._check_connection()
        self._take_lease_ends()
        self._advance_holds(now)
        for load in list(self._loads.values()):
            self._advance_load(load, now)
        meta = AdapterMetadata(
            loads=self._pending_specs,
            commits=self._pending_commits,
            frees=self._pending_frees,
            stores=self._pending_stores,
        )
        self._pending_specs, self._pending_commits, self._pending_frees = [], [], []
        self._pending_stores = []
        self._publish_stats()
        return meta

    @_locked
    def update_connector_output(
        self,
        *,
        worker_meta: Any,
        finished_sending: set[str] | None,
        finished_recving: set[str] | None,
    ) -> None:
        if isinstance(worker_meta, ReadOutcomes):
            for req_id, reason in worker_meta.failed.items():
                load = self._loads.get(req_id)
                if load is not None and not load.failure:
                    load.failure = reason
            for req_id, count in worker_meta.done.items():
                load = self._loads.get(req_id)
                if load is None or load.state != "reading":
                    continue
                load.ranks_done += count
                load.bytes_read += worker_meta.bytes_read.get(req_id, 0)
                if load.ranks_done >= self.expected_ranks:
                    self._finish_reads(load)
            for store_id, reason in worker_meta.stores_failed.items():
                store = self._stores.get(store_id)
                if store is not None and not store.failure:
                    store.failure = reason
            for store_id, count in worker_meta.stores_done.items():
                store = self._stores.get(store_id)
                if store is None:
                    continue
                store.ranks_done += count
                if store.ranks_done >= self.expected_ranks:
                    self._finish_store(store_id)
        for req_id in finished_recving or ():
            self._loads.pop(req_id, None)
        for req_id in finished_sending or ():
            held = self._held.get(req_id)
            if held is not None and held.pin is HoldPin.DELAY_FREE:
                self._returned(held)  # vLLM has now put the blocks back into its free pool
        self._publish_stats()

    def _returned(self, held: _Held) -> None:
        """The hold is over and its blocks are vLLM's again."""
        del self._held[held.request_id]
        self._held_by_lease.pop(held.lease_id, None)
        self.stats.count("holds_returned")
        self.stats.count("held_blocks_returned", len(held.block_ids))

    @_locked
    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._failed_loads.discard(req_id)
        named = self._named_holds.pop(req_id, None)
        if named is not None:
            self._decline(req_id, named, None)  # finished (aborted) before it was scheduled
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None and lookup.span is not None:
            end_span(lookup.span, {"kvbroker.decision": "request_finished_before_decision"})
        load = self._loads.get(req_id)
        if load is not None:
            # Aborted while loading: vLLM keeps its blocks until we report the
            # load finished; the protocol completes normally.
            load.aborted = True
            return False, None
        pin, params = self._hold_finished(request, block_ids)
        # A CPU-tier copy keeps the request in vLLM (delay_free) until the copy is done;
        # the worker then reports it freed, unless a delay_free hold still needs it.
        storing = self.cpu is not None and self._store_finished(
            request, block_ids, free_after_copy=pin is not HoldPin.DELAY_FREE
        )
        return pin is HoldPin.DELAY_FREE or storing, params

    def _hold_finished(
        self, request: Any, block_ids: Sequence[int]
    ) -> tuple[HoldPin | None, dict[str, Any] | None]:
        """Hold a finished request's blocks for a reader when one will take them; says how they stay."""
        req_id = request.request_id
        try:
            params = parse_transfer_params(request.kv_transfer_params)
        except BadTransferParams as e:
            # Already logged (warning) when the request arrived; one line per request is enough.
            logger.debug("kvbroker: request %s: ignoring kv_transfer_params: %s", req_id, e)
            return None, None
        if not (params.do_remote_decode or self.config.multi_turn):
            return None, None
        if not _finished_normally(request):
            return None, None
        link = self.link
        if link is None or not link.connected or not link.layout_id:
            logger.info("kvbroker: request %s: not holding its blocks: broker unreachable", req_id)
            return None, self._decode_params(0) if params.do_remote_decode else None
        n = holdable_blocks(
            request.num_computed_tokens, len(request.block_hashes), len(block_ids), self.block_size
        )
        if n == 0:
            return None, self._decode_params(0) if params.do_remote_decode else None
        namespace = self._namespace(request)
        hashes = wire_hashes(request.block_hashes[:n])
        held_ids = list(block_ids[:n])
        future = link.hold(
            namespace,
            hashes,
            held_ids,
            ttl_ms=self.config.hold_ttl_ms,
            request_id=req_id,
            reader_engine_id=params.reader_engine_id,
        )
        pin = HoldPin.DELAY_FREE
        if self._block_pool is not None:
            pool = self._block_pool
            pool.touch([pool.blocks[i] for i in held_ids])
            pin = HoldPin.BLOCK_POOL
        held = _Held(req_id, namespace, hashes, held_ids, self._clock(), future, pin)
        self._held[req_id] = held
        self.stats.count("holds_requested")
        # The reply may come while vLLM is idle: settle it on the session thread then.
        future.add_done_callback(lambda _: self.on_link_event())
        return pin, self._decode_params(n, hold_request_id=req_id) if params.do_remote_decode else None

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()
        if self._stats_writer is not None:
            self._stats_writer.submit(self.stats_snapshot())  # once more: the final counts
            self._stats_writer.close()

    # ------------------------------------------------------------------
    # CPU offload tier
    # ------------------------------------------------------------------

    def _store_finished(self, request: Any, block_ids: Sequence[int], *, free_after_copy: bool) -> bool:
        """Copy the request's full blocks (prefix hits included) to the CPU tier; True if a copy started.

        vLLM keeps the blocks (delay_free) until the copy is done: the worker
        reports the request freed only then, so no new request overwrites
        them mid-copy.
        """
        assert self.cpu is not None
        link = self.link
        if not _finished_normally(request) or link is None or not link.layout_id:
            return False
        n = holdable_blocks(
            request.num_computed_tokens, len(request.block_hashes), len(block_ids), self.block_size
        )
        if n == 0:
            return False
        namespace = self._namespace(request)
        keys = [(namespace.layout_id, namespace.tenant, h) for h in wire_hashes(request.block_hashes[:n])]
        position = {key: i for i, key in enumerate(keys)}
        allocation = self.cpu.allocate(keys)
        if allocation.evicted:
            self.stats.count("cpu_evicted_blocks", len(allocation.evicted))
            self._announce_cpu(allocation.evicted, stored=False)
        self.stats.count("cpu_store_skipped_present", allocation.skipped_present)
        self.stats.count("cpu_store_no_room", allocation.no_room)
        if not allocation.assigned:
            return False
        store_id = self._next_store_id
        self._next_store_id += 1
        slots = [slot for _, slot in allocation.assigned]
        gpu_ids = [int(block_ids[position[key]]) for key, _ in allocation.assigned]
        self._stores[store_id] = _Store(request.request_id, slots)
        self._pending_stores.append(StoreSpec(store_id, request.request_id, tuple(gpu_ids), tuple(slots)))
        if free_after_copy:
            # The worker reports the request freed once its copy is done.
            self._pending_frees.append(request.request_id)
        self.stats.count("cpu_stores")
        return True

    def _finish_store(self, store_id: int) -> None:
        assert self.cpu is not None
        store = self._stores.pop(store_id)
        if store.failure:
            self.cpu.discard(store.slots)
            self.stats.count("cpu_stores_failed")
            logger.warning(
                "kvbroker: request %s: copy of %d blocks to the CPU tier failed: %s",
                store.request_id,
                len(store.slots),
                store.failure,
            )
        else:
            ready = self.cpu.mark_ready(store.slots)
            self.stats.count("cpu_stored_blocks", len(ready))
            self._announce_cpu(ready, stored=True)
            logger.debug("kvbroker: request %s: %d blocks on the CPU tier", store.request_id, len(ready))

    def _announce_cpu(self, keys: Sequence[BlockKey], *, stored: bool) -> None:
        if self.link is None:
            return
        by_namespace: dict[tuple[str, str], list[int]] = {}
        for layout_id, tenant, h in keys:
            by_namespace.setdefault((layout_id, tenant), []).append(h)
        for (layout_id, tenant), hashes in by_namespace.items():
            namespace = pb.Namespace(layout_id=layout_id, tenant=tenant)
            if stored:
                self.link.announce_stored(namespace, hashes, pb.TIER_CPU)
            else:
                self.link.announce_removed(namespace, hashes, pb.TIER_CPU)

    @_locked
    def pin_cpu_blocks(self, command: pb.PinCommand) -> pb.PinResult:
        """Broker PinCommand (session thread): pin CPU-tier slots for a reader's lease."""
        lease = command.lease
        if lease.tier != pb.TIER_CPU or self.cpu is None:
            return pb.PinResult(
                lease_id=lease.lease_id, ok=False, error="pinning unheld GPU blocks is not supported"
            )
        ns = lease.namespace
        keys = [(ns.layout_id, ns.tenant, int(h)) for h in lease.block_hashes]
        slots = self.cpu.pin(lease.lease_id, keys)
        self.stats.count("cpu_pins" if slots is not None else "cpu_pins_refused")
        if slots is None:
            return pb.PinResult(
                lease_id=lease.lease_id, ok=False, error="blocks are not (or no longer) on the CPU tier"
            )
        logger.info(
            "kvbroker: pinned %d CPU-tier blocks for lease %s (reader %s)",
            len(slots),
            lease.lease_id,
            lease.reader_engine_id,
        )
        return pb.PinResult(lease_id=lease.lease_id, ok=True, block_ids=slots)

    @_locked
    def unpin_cpu_blocks(self, lease_id: str) -> None:
        """A lease ended (session thread): its CPU-tier slots may be evicted again."""
        if self.cpu is not None:
            self.cpu.unpin(lease_id)

    # ------------------------------------------------------------------
    # lookups
    # ------------------------------------------------------------------

    def _start_lookup(self, request: Any, now: float) -> _Lookup | None:
        req_id = request.request_id
        try:
            params = parse_transfer_params(request.kv_transfer_params)
        except BadTransferParams as e:
            self._skip(req_id, SKIP_BAD_PARAMS, f"{e}; recomputing")
            return None
        if params.holder_engine_id and params.hold_request_id:
            self._named_holds[req_id] = (params.holder_engine_id, params.hold_request_id)
        if params.holder_tp_size:
            # The named holder's answer says its blocks are split for another TP size:
            # refuse now, with the reason, instead of waiting for a holder the broker filters out.
            mismatch = check_sizes(
                reader_tp=self.tp_size,
                holder_tp=params.holder_tp_size,
                reader_pp=self.pp_size,
                holder_pp=params.holder_pp_size or 1,
            )
            if mismatch is not None:
                self._skip(
                    req_id, SKIP_INCOMPATIBLE, f"holder {params.holder_engine_id}: {mismatch}; recomputing"
                )
                return None
        link = self.link
        broker_up = link is not None and link.connected and bool(link.layout_id)
        if not broker_up and (self.cpu is None or link is None or not link.layout_id):
            self._skip(req_id, SKIP_NO_BROKER, "broker unreachable; recomputing")
            return None
        hashes = wire_hashes(request.block_hashes)
        if not hashes:
            return None  # shorter than one block: nothing anyone could hold
        lookup = _Lookup(
            request_id=req_id,
            params=params,
            namespace=self._namespace(request),
            hashes=hashes,
            budget=_Budget(self.config.resolve_wait_ms / 1000.0, now),
        )
        lookup.span = start_span(
            "kvbroker.resolve",
            params.trace_context,
            {
                "kvbroker.request_id": req_id,
                "kvbroker.engine_id": self.config.engine_id,
                "kvbroker.blocks": len(hashes),
                "kvbroker.layout_id": lookup.namespace.layout_id,
            },
        )
        self._lookups[req_id] = lookup
        if not broker_up:
            # The broker is away; this engine's own CPU tier needs none (see the decision).
            lookup.decision = Decision(None, SKIP_NO_BROKER, "broker unreachable; recomputing")
            lookup.answered_by = "none"
            return lookup
        if self.config.index_mirror and self._answer_from_mirror(lookup):
            return lookup
        self._submit_resolve(lookup, now)
        return lookup

    def _answer_from_mirror(self, lookup: _Lookup) -> bool:
        """Decide from the local index mirror, in this step, when it can answer.

        It cannot while unsynced. Requests whose kv_transfer_params name a holder
        (P -> D) still ask the broker: its answer carries the id of the hold lease
        to claim, which the mirror does not know, so P's blocks are freed the
        moment this engine has read them."""
        assert self.link is not None
        if lookup.params.holder_engine_id:
            return False
        matches = self.link.mirror_resolve(lookup.namespace, lookup.hashes)
        if matches is None:
            return False
        lookup.response = lookup.last_response = pb.ResolveResponse(matches=matches)
        lookup.decision = Decision(None, "resolved")
        lookup.answered_by = "mirror"
        self.stats.count("mirror_answers")
        return True

    def _submit_resolve(self, lookup: _Lookup, now: float) -> None:
        assert self.link is not None
        lookup.future = self.link.resolve(
            lookup.namespace,
            lookup.hashes,
            acquire=False,
            lease_ttl_ms=0,
            min_blocks=0,
            request_id=lookup.request_id,
        )
        lookup.last_submit = now

    def _poll_lookup(self, lookup: _Lookup, now: float) -> Decision | None:
        budget_left = lookup.budget.left(now)
        future = lookup.future
        hint = lookup.params.holder_engine_id
        if future is not None and future.done():
            error = future.exception()
            if error is not None:
                return Decision(None, SKIP_ERROR, f"resolve failed: {error}; recomputing")
            response = future.result()
            lookup.last_response = response
            named = {m.engine_id for m in response.matches}
            if not hint or hint in named:
                lookup.response = response
                return Decision(None, "resolved")
            if budget_left > 0:
                # P's hold may reach the broker just after its answer reached the router.
                if now - lookup.last_submit >= _HINT_RETRY_S:
                    self._submit_resolve(lookup, now)
                return None
        if budget_left > 0:
            return None
        if lookup.last_response is None:
            return Decision(
                None, SKIP_TIMEOUT, f"no broker answer within resolve_wait_ms={self.config.resolve_wait_ms}"
            )
        lease_note = f" (lease {lookup.params.lease_id})" if lookup.params.lease_id else ""
        logger.warning(
            "kvbroker: request %s: kv_transfer_params name holder %s%s, but the broker knows no such "
            "holder of this prompt; using what the broker knows",
            lookup.request_id,
            hint,
            lease_note,
        )
        lookup.response = lookup.last_response
        return Decision(None, "resolved")

    def _log_decision(self, req_id: str, lookup: _Lookup, decision: Decision) -> None:
        if lookup.logged:
            return
        lookup.logged = True
        plan = decision.plan
        end_span(
            lookup.span,
            {
                "kvbroker.decision": decision.reason,
                "kvbroker.skip_reason": "" if plan else decision.reason,
                "kvbroker.holder_engine_id": plan.holder_engine_id if plan else "",
                "kvbroker.remote_tokens": plan.num_tokens if plan else 0,
                "kvbroker.local_tokens": lookup.num_local_tokens,
                "kvbroker.answered_by": lookup.answered_by,
            },
        )
        lookup.span = None
        if decision.plan is None:
            self._skip(req_id, decision.reason, decision.detail)
        else:
            logger.info(
                "kvbroker: request %s: pulling %d blocks (%d tokens) from %s (tier %s)",
                req_id,
                decision.plan.num_blocks,
                decision.plan.num_tokens,
                decision.plan.holder_engine_id,
                _tier_name(decision.plan.tier),
            )

    def _skip(self, req_id: str, reason: str, detail: str) -> None:
        self.stats.skip(reason)
        level = (
            logging.WARNING if reason in (SKIP_BAD_PARAMS, SKIP_ERROR, SKIP_INCOMPATIBLE) else logging.INFO
        )
        logger.log(level, "kvbroker: request %s: not pulling (%s): %s", req_id, reason, detail)

    # ------------------------------------------------------------------
    # loads
    # ------------------------------------------------------------------

    def _advance_load(self, load: _Load, now: float) -> None:
        if load.state == "acquiring":
            future = load.future
            if future is None or not future.done():
                if load.budget.left(now) < 0:
                    self._fail_load(
                        load, f"lease not granted within acquire_wait_ms={self.config.acquire_wait_ms}"
                    )
                    if future is not None:
                        future.add_done_callback(self._release_abandoned)
                return
            error = future.exception()
            if error is not None:
                self._fail_load(load, f"lease refused: {error}")
                return
            self._start_reads(load, future.result())
        elif load.state == "releasing":
            future = load.future
            if future is None or not future.done():
                return
            error = future.exception()
            if error is not None:
                self._fail_load(load, f"release failed, the read is not committed: {error}")
                return
            self._commit(load, ok=True, reason="released")

    def _start_reads(self, load: _Load, response: pb.ResolveResponse | pb.LeaseResponse) -> None:
        lease = response.lease if response.HasField("lease") else None
        if lease is None or not lease.lease_id:
            skipped = getattr(response, "skipped_reason", "") or "no lease"
            self._fail_load(load, f"broker granted no lease ({skipped})")
            return
        load.lease = lease
        holder = response.holder
        reason = check_sizes(
            reader_tp=self.tp_size,
            holder_tp=holder.layout.tp_size or 1,
            reader_pp=self.pp_size,
            holder_pp=holder.layout.pp_size or 1,
        )
        if reason is None:
            remote_ids, reason = _remote_block_ids(lease, load.hashes, load.plan)
        if reason is None:
            ranks, reason = _holder_ranks(holder, lease.tier)
        if reason is not None:
            self._fail_load(
                load, f"holder {holder.engine_id or lease.holder_engine_id} incompatible: {reason}"
            )
            return
        load.state = "reading"
        if load.span is not None:
            # Which holder rank serves which layers, for the trace: "pp0/tp0:[0,2)".
            load.span.set_attribute(
                "kvbroker.source_ranks",
                ",".join(f"pp{r.pp_rank}/tp{r.tp_rank}:[{r.start_layer},{r.end_layer})" for r in ranks),
            )
            load.span.set_attribute("kvbroker.destination_ranks", self.tp_size * self.pp_size)
            load.span.set_attribute("kvbroker.lease_id", lease.lease_id)
        self._pending_specs.append(
            LoadSpec(
                request_id=load.request_id,
                lease_id=lease.lease_id,
                holder_engine_id=lease.holder_engine_id,
                tier=int(lease.tier),
                remote_block_ids=tuple(remote_ids),
                local_block_ids=load.local_block_ids,
                holder_ranks=tuple(ranks),
            )
        )

    def _local_cpu_blocks(self, lookup: _Lookup) -> int:
        """How much of the request's chain this engine's own CPU tier can restore."""
        if self.cpu is None:
            return 0
        ns = lookup.namespace
        return self.cpu.ready_prefix([(ns.layout_id, ns.tenant, h) for h in lookup.hashes])

    def _start_local_restore(self, load: _Load) -> None:
        """Copy blocks back from our own CPU tier: no broker, no lease; a pin keeps the slots."""
        assert self.cpu is not None
        plan, ns = load.plan, load.namespace
        chain = load.hashes[plan.first_block : plan.first_block + plan.num_blocks]
        pin = LOCAL_PIN_PREFIX + load.request_id
        slots = self.cpu.pin(pin, [(ns.layout_id, ns.tenant, h) for h in chain])
        if slots is None:
            self._fail_load(load, "the blocks left the CPU tier before they could be copied back")
            return
        load.local_pin = pin
        load.state = "reading"
        self._pending_specs.append(
            LoadSpec(
                request_id=load.request_id,
                lease_id=pin,
                holder_engine_id=self.config.engine_id,
                tier=pb.TIER_CPU,
                remote_block_ids=tuple(slots),
                local_block_ids=load.local_block_ids,
                holder_ranks=(),
            )
        )

    def _unpin_local(self, load: _Load) -> None:
        if load.local_pin and self.cpu is not None:
            self.cpu.unpin(load.local_pin)
        load.local_pin = ""

    def _finish_reads(self, load: _Load) -> None:
        if load.local_pin:
            if load.failure:
                self._fail_load(load, f"copy from the CPU tier failed: {load.failure}")
            else:
                self._commit(load, ok=True, reason="restored")
            return
        assert load.lease is not None and self.link is not None
        if load.failure:
            self._fail_load(load, f"NIXL read failed: {load.failure}")
            return
        load.state = "releasing"
        with current(load.span):
            load.future = self.link.release(load.lease.lease_id, load.lease.epoch)

    def _fail_load(self, load: _Load, reason: str) -> None:
        if load.lease is not None and load.state != "releasing" and self.link is not None:
            # End the lease at once so the holder frees; the bytes are not used either way.
            self.link.release(load.lease.lease_id, load.lease.epoch)
        self.stats.count("pulls_failed")
        logger.warning(
            "kvbroker: request %s: pull of %d blocks from %s failed, recomputing them: %s",
            load.request_id,
            load.plan.num_blocks,
            load.plan.holder_engine_id,
            reason,
        )
        self._commit(load, ok=False, reason=reason)

    def _commit(self, load: _Load, *, ok: bool, reason: str) -> None:
        load.state = "done"
        self._unpin_local(load)  # every load ends here; a restore's slots may be evicted again
        elapsed_s = self._clock() - load.started
        end_span(
            load.span,
            {
                "kvbroker.lease_id": load.lease.lease_id if load.lease else "",
                "kvbroker.bytes": load.bytes_read,
                "kvbroker.duration_ms": elapsed_s * 1000.0,
                "kvbroker.gb_per_s": load.bytes_read / elapsed_s / 1e9 if elapsed_s > 0 else 0.0,
                "kvbroker.committed": ok,
                "kvbroker.skip_reason": "" if ok else reason,
            },
            error="" if ok else reason,
        )
        load.span = None
        if ok and load.plan.holder_engine_id == self.config.engine_id:
            self.stats.count("cpu_restores")
            self.stats.count("cpu_restored_blocks", load.plan.num_blocks)
            logger.info(
                "kvbroker: request %s: restored %d blocks (%d bytes) from this engine's CPU tier in %.1f ms",
                load.request_id,
                load.plan.num_blocks,
                load.bytes_read,
                elapsed_s * 1000.0,
            )
        elif ok:
            if load.lease is not None:
                self.stats.count(f"pulled_blocks_{_tier_name(load.lease.tier).lower()}", load.plan.num_blocks)
            self.stats.count("pulls")
            self.stats.count("pulled_blocks", load.plan.num_blocks)
            self.stats.count("pulled_bytes", load.bytes_read)
            logger.info(
                "kvbroker: request %s: pulled %d blocks (%d bytes) from %s in %.1f ms, lease %s released",
                load.request_id,
                load.plan.num_blocks,
                load.bytes_read,
                load.plan.holder_engine_id,
                elapsed_s * 1000.0,
                load.lease.lease_id if load.lease else "",
            )
        if not ok:
            self._failed_loads.add(load.request_id)
        self._pending_commits.append(Commit(load.request_id, ok, load.local_block_ids, reason))

    def _decline(self, req_id: str, named: tuple[str, str], decision: Decision | None) -> None:
        """We will not read the hold the router named for us: its holder frees it now, not at its TTL."""
        holder, hold_request_id = named
        why = decision.reason if decision is not None and decision.plan is None else "not pulled from it"
        self.stats.count("holds_declined")
        if self.link is None or not self.link.connected:
            return  # the hold ends by its TTL; nothing else can end it
        logger.info(
            "kvbroker: request %s: declining %s's hold of request %s (%s)",
            req_id,
            holder,
            hold_request_id,
            why,
        )
        self.link.decline(holder, hold_request_id, f"reader {self.config.engine_id}: {why}")

    def _release_abandoned(self, future: Future[Any]) -> None:
        """A lease granted after we gave up on it: end it so the holder frees."""
        if future.exception() is not None or self.link is None:
            return
        lease = future.result().lease
        if lease.lease_id:
            self.link.release(lease.lease_id, lease.epoch)

    # ------------------------------------------------------------------
    # holds
    # ------------------------------------------------------------------

    def _advance_holds(self, now: float) -> None:
        backstop = (self.config.hold_ttl_ms + 2 * self.config.session_ttl_ms) / 1000.0
        for held in list(self._held.values()):
            if held.freed:
                continue
            future = held.future
            if not held.lease_id and future is not None and future.done():
                error = future.exception()
                lease_id = "" if error is not None else future.result().lease_id
                if not lease_id:
                    logger.warning(
                        "kvbroker: request %s: hold refused, freeing %d blocks: %s",
                        held.request_id,
                        len(held.block_ids),
                        error,
                    )
                    self._free(held, "hold refused")
                    continue
                held.lease_id = lease_id
                self._held_by_lease[lease_id] = held.request_id
                if lease_id in self._ended_leases:
                    self._ended_leases.discard(lease_id)
                    self._free(held, "lease ended")
                    continue
                self._announce(held, stored=True)
            if now - held.started > backstop:
                # Every lease ends: if no notice ever came, do not pin blocks forever.
                self._free(held, "no lease-end notice within hold TTL + 2 session TTLs")

    def _take_lease_ends(self) -> None:
        if self.link is None:
            return
        for notice in self.link.take_lease_ends():
            req_id = self._held_by_lease.get(notice.lease_id)
            held = self._held.get(req_id) if req_id else None
            if held is None:
                # Maybe a hold whose reply has not reached us yet; remember it only then.
                if any(not h.lease_id and not h.freed for h in self._held.values()):
                    self._ended_leases.add(notice.lease_id)
                continue
            self._free(held, f"lease {notice.lease_id} ended ({notice.cause})")

    def _free(self, held: _Held, why: str) -> None:
        if held.freed:
            return
        held.freed = True
        self._announce(held, stored=False)
        if held.pin is HoldPin.BLOCK_POOL:
            # Our pool reference goes at the scheduler thread's next hook, before any
            # allocation that could need the blocks; vLLM freed the request long ago.
            self._pool_returns.append(held.block_ids)
            self._returned(held)
        else:
            self._pending_frees.append(held.request_id)
        self.stats.count("holds_freed")
        logger.info(
            "kvbroker: request %s: freeing %d held blocks: %s", held.request_id, len(held.block_ids), why
        )

    def _announce(self, held: _Held, *, stored: bool) -> None:
        """Announce each (namespace, hash) once, however many holds cover it."""
        if self.link is None or held.announced == stored:
            return
        held.announced = stored
        changed: list[int] = []
        for h in held.hashes:
            key = (held.namespace.layout_id, held.namespace.tenant, h)
            if stored:
                self._announced[key] += 1
                if self._announced[key] == 1:
                    changed.append(h)
            else:
                self._announced[key] -= 1
                if self._announced[key] <= 0:
                    del self._announced[key]
                    changed.append(h)
        if changed:
            if stored:
                self.link.announce_stored(held.namespace, changed)
            else:
                self.link.announce_removed(held.namespace, changed)

    def _check_connection(self) -> None:
        connected = self.link is not None and self.link.connected
        if self._was_connected and not connected:
            # The broker lost our leases with our session: nobody can claim these blocks.
            for held in list(self._held.values()):
                self._free(held, "broker session lost")
            if self.cpu is not None:
                self.cpu.unpin_all(keep_prefix=LOCAL_PIN_PREFIX)
        self._was_connected = connected

    # ------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------

    def _namespace(self, request: Any) -> pb.Namespace:
        salt = getattr(request, "cache_salt", None) or ""
        tenant = f"{self.config.tenant}/{salt}" if self.config.tenant else salt
        assert self.link is not None
        return pb.Namespace(layout_id=self.link.layout_id, tenant=tenant)

    def _decode_params(self, num_blocks: int, hold_request_id: str = "") -> dict[str, Any]:
        """kv_transfer_params that make D pull (through the broker) instead of prefill."""
        broker_part: dict[str, Any] = {
            "holder_engine_id": self.config.engine_id,
            "num_blocks": num_blocks,
            # A reader with another TP size refuses at once (engine_adapter/topology.py).
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
        }
        if hold_request_id:
            # Names the hold, so a reader (or the router) that will not read it declines it.
            broker_part["hold_request_id"] = hold_request_id
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "kvbroker": broker_part,
        }

    @_locked
    def stats_snapshot(self) -> dict[str, Any]:
        live = [h for h in self._held.values() if not h.freed]
        snapshot = self.stats.as_dict(len(live), sum(len(h.block_ids) for h in live))
        if self.cpu is not None:
            snapshot["cpu_tier_used_slots"] = self.cpu.used_slots()
            snapshot["cpu_tier_pinned_slots"] = self.cpu.pinned_slots()
        return snapshot

    def _publish_stats(self) -> None:
        """Hand changed counters to the writer thread: no file I/O on vLLM's scheduler thread."""
        if self._stats_writer is None or not self.stats.dirty:
            return
        self.stats.dirty = False
        self._stats_writer.submit(self.stats_snapshot())


def _tier_name(tier: int) -> str:
    return pb.Tier.Name(tier)  # type: ignore[arg-type]


def _finished_normally(request: Any) -> bool:
    status = getattr(request, "status", None)
    name = getattr(status, "name", str(status))
    return name in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def _remote_block_ids(lease: pb.Lease, hashes: list[int], plan: PullPlan) -> tuple[list[int], str | None]:
    """Holder block ids for the planned chain positions, matched by hash."""
    if len(lease.block_ids) != len(lease.block_hashes):
        return [], f"lease has {len(lease.block_hashes)} hashes but {len(lease.block_ids)} block ids"
    by_hash = dict(zip(lease.block_hashes, lease.block_ids, strict=True))
    ids: list[int] = []
    for pos in range(plan.first_block, plan.first_block + plan.num_blocks):
        block_id = by_hash.get(hashes[pos]) if pos < len(hashes) else None
        if block_id is None:
            return [], f"the lease does not cover block {pos} of the prompt"
        ids.append(block_id)
    return ids, None


def _holder_ranks(holder: pb.EngineInfo, tier: int) -> tuple[list[HolderRank], str | None]:
    ranks: list[HolderRank] = []
    for rank in holder.ranks:
        capacity = max((int(t.num_blocks) for t in rank.tiers if t.tier == tier), default=0)
        regions = [
            RegionSpec(r.layer, r.base_addr, r.block_stride, r.block_bytes, r.device_id)
            for t in rank.tiers
            if t.tier == tier
            for r in t.regions
        ]
        if not rank.agent_name or not regions:
            continue
        mem_type = next((t.mem_type for t in rank.tiers if t.tier == tier), "")
        ranks.append(
            HolderRank(
                pp_rank=rank.pp_rank,
                tp_rank=rank.tp_rank,
                agent_name=rank.agent_name,
                agent_metadata=bytes(rank.agent_metadata),
                start_layer=rank.start_layer,
                end_layer=rank.end_layer,
                regions=tuple(regions),
                num_blocks=capacity,
                mem_type=mem_type,
            )
        )
    if not ranks:
        return [], f"the holder has registered no rank with memory on tier {_tier_name(tier)}"
    return ranks, None
