"""Scheduler side of the connector: decide pull vs recompute, take and release
leases, hold finished requests' blocks for readers.

Runs inside vLLM's scheduler loop and never blocks on the broker: every broker
call is a Future, checked again at the next step, except that a step waits up
to ``step_wait_ms`` (without the lock) for a pull's answer due in it: the lease
of a pull allocated in it, the release of a read done in its output. A request waits either in
vLLM's "ask again" state (``get_num_new_matched_tokens`` -> None) while its
lookup is pending, or in WAITING_FOR_REMOTE_KVS while its lease is acquired,
its blocks are read and the lease is released. Whatever goes wrong, the
request is handed back to vLLM to recompute, with one log line saying why.

``AdapterScheduler`` is the facade vLLM's hooks (through connector.py) and the
broker session's thread call. It owns the shared state (``SchedulerContext``,
the lock) and composes the parts:

- lookups.py: who holds a prompt's prefix (index mirror or broker), the wait
  budgets, the pull-or-recompute decision, declines of named holds;
- loads.py: lease acquire, LoadSpecs for the worker, release commits the read;
- holds.py: finished requests' blocks held for readers, vLLM's block pool;
- cpu_stores.py: copies to the CPU offload tier and pins of it for readers;
- retention_pressure.py: retention pins given up when vLLM needs the GPU memory;
- gpu_inventory.py: every block vLLM's prefix cache has, announced, and pins
  of cached blocks no hold covers;
- stats.py: the counters, and the thread that writes ``stats_path``;
- cost_model.py: what a prefill and a pull cost here, from this engine's own
  steps (``build_connector_meta``) and loads; pull_policy.py decides from it;
- own_load.py: this engine's load, reported to the broker for its readers.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from typing import Any, ParamSpec, TypeVar

from kvbroker.engine_adapter.broker_link import BrokerLink, NewGeneration
from kvbroker.engine_adapter.config import AdapterConfig
from kvbroker.engine_adapter.cost_model import CostModel
from kvbroker.engine_adapter.cpu_directory import CpuDirectory
from kvbroker.engine_adapter.cpu_stores import CpuStores
from kvbroker.engine_adapter.decisions import holdable_blocks
from kvbroker.engine_adapter.gpu_inventory import GpuInventory
from kvbroker.engine_adapter.holds import HoldPin, Holds
from kvbroker.engine_adapter.loads import LOCAL_PIN_PREFIX, Loads, LoadState
from kvbroker.engine_adapter.lookups import Lookups
from kvbroker.engine_adapter.metadata import AdapterMetadata, ReadOutcomes
from kvbroker.engine_adapter.retention_pressure import RetentionPressure
from kvbroker.engine_adapter.scheduler_context import SchedulerContext
from kvbroker.engine_adapter.stats import SchedulerStats, StatsWriter
from kvbroker.v1 import broker_pb2 as pb

# Longest an empty scheduler step waits for a broker answer its requests need (GIL released).
IDLE_WAIT_S = 0.002
# How long an empty step sleeps while its only work is reads on the workers (GIL released).
# vLLM steps again at once: a PP=2 reader's 5.7 s first read took 3,284 steps (one per 1.7 ms,
# the engine core and both workers busy), and on a shared host that spin starved the holder
# whose progress a new reader's connection set-up needs until the read timed out. With the
# sleep: 113 steps for a 0.96 s read. A read's end is seen up to this much later.
IDLE_READ_WAIT_S = 0.005

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run under the scheduler's lock: hold state is shared with the session thread."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with args[0]._lock:  # type: ignore[attr-defined]
            return method(*args, **kwargs)

    return wrapper


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
        block_bytes: int = 0,
        chunk_tokens: int = 0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self.link = link
        self.block_size = block_size
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.expected_ranks = tp_size * pp_size
        self._clock = clock
        self._sleep = sleep
        self.stats = SchedulerStats()
        # CPU offload tier (cpu_tier_blocks > 0): the slot directory.
        self.cpu = CpuDirectory(config.cpu_tier_blocks) if config.cpu_tier_blocks > 0 else None
        self._ctx = SchedulerContext(
            config=config,
            link=link,
            block_size=block_size,
            tp_size=tp_size,
            pp_size=pp_size,
            clock=clock,
            stats=self.stats,
            cpu=self.cpu,
            costs=CostModel(block_bytes=block_bytes, chunk_tokens=chunk_tokens),
        )
        self.costs = self._ctx.costs
        self.lookups = Lookups(self._ctx)
        self.loads = Loads(self._ctx)
        self.gpu = GpuInventory(self._ctx)
        self.pressure = RetentionPressure(self.gpu, config.retain_gpu_low_water, block_size)
        self.holds = Holds(self._ctx, self.gpu, on_reply=self.on_link_event)
        self.stores = CpuStores(self._ctx)
        self.own_load = self._ctx.own_load
        self._was_connected = False
        self._session_id = ""  # the broker session our holds and pins belong to
        self._lost_at: float | None = None  # when the scheduler saw that session's stream break
        # Engines the broker said registered anew, for the workers with the next step's metadata.
        self._generations: list[NewGeneration] = []
        # Writes stats_path on its own thread, from snapshots taken here.
        self._stats_writer = StatsWriter(config.stats_path) if config.stats_path else None
        # vLLM's hooks run on the scheduler thread; lease ends, hold replies, pins and
        # connection changes arrive on the session thread, which settles holds itself
        # so that an idle engine (no scheduler steps) still frees at once.
        self._lock = threading.RLock()
        if link is not None:
            link.set_pin_handlers(self.pin_blocks, self.unpin_blocks)
            link.set_event_listener(self.on_link_event)
        # A restarted engine replaces the file its previous run left now, not at its
        # first request: until then readers would take a dead engine's counters as ours.
        self._publish_stats()

    def bind_block_pool(self, block_pool: Any, wake: Callable[[], None] | None = None) -> None:
        """vLLM's block pool: holds keep their blocks with a pool reference (HoldPin.BLOCK_POOL),
        every block it caches is announced, and readers may pin cached blocks.
        ``wake`` makes an idle engine step (engine_adapter/wakeup.py)."""
        self.holds.bind_block_pool(block_pool)
        self.gpu.bind(block_pool)
        self.gpu.wake = wake

    def has_pool_returns(self) -> bool:
        """Work only the scheduler thread may do: ended holds' blocks, pins of cached blocks, and
        digests the workers are to state (verify_bytes), which go out with a step's metadata."""
        return (
            self.holds.has_pool_returns()
            or self.gpu.has_work()
            or bool(self._ctx.pending_digests)
            or bool(self._generations)  # the workers drop a replaced engine's agents in a step
        )

    def read_cache_events(self) -> None:
        """vLLM's KV cache events since the last look: evicted blocks are announced removed."""
        with self._lock:
            self.gpu.read_events()

    def return_held_blocks(self) -> bool:
        """Give ended holds' blocks back to vLLM's pool (scheduler thread only); True if any."""
        with self._lock:
            returns = self.holds.take_pool_returns()
        return self.holds.give_back(returns)

    @_locked
    def on_link_event(self) -> None:
        """Session thread: a lease ended, a hold was answered, an engine registered anew, or the
        connection changed."""
        if self._take_generations():
            self.gpu.wake_engine()  # an idle engine steps once: its workers drop the old agents now
        self._check_connection()
        # Answered holds first: a lease-end notice never comes before its Hold's answer.
        self.holds.advance(self._clock())
        self.holds.take_lease_ends()
        self._publish_stats()

    # ------------------------------------------------------------------
    # vLLM hooks
    # ------------------------------------------------------------------

    @_locked
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.return_held_blocks()
        self.pressure.on_waiting(request, num_computed_tokens)  # vLLM allocates for it next
        if request.request_id in self.loads.failed:
            return 0, False
        return self.lookups.matched_tokens(request, num_computed_tokens, self._clock())

    @_locked
    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self.own_load.allocated(req_id)
        lookup, named = self.lookups.pop(req_id)
        if req_id in self.loads.active:
            return
        plan = self.lookups.plan_after_alloc(req_id, lookup, named, num_external_tokens)
        if lookup is not None and plan is not None:
            # The holder's load the decision weighed: the pull's observation is made at it.
            holder_load = lookup.costs.holder_load if lookup.costs is not None else 0.0
            self.costs.pull_started(plan.holder_engine_id, holder_load)
            self.loads.start(lookup, plan, block_ids, num_external_tokens)

    def build_connector_meta(
        self, scheduled: Sequence[tuple[str, int, int]] | None = None
    ) -> AdapterMetadata:
        """``scheduled``: the step's (request id, new tokens, context tokens). It times the last step
        for the cost model and marks a loaded request's remainder prefill for its pull timeline.

        The leases of pulls allocated in this step are waited for first (up to ``step_wait_ms``):
        granted, their reads start in this step instead of the next one. A step with nothing
        scheduled while reads run sleeps IDLE_READ_WAIT_S first (vLLM would spin on it)."""
        self._wait_for_answers(in_output=False)
        if scheduled is not None and not scheduled:
            with self._lock:
                reading = any(ld.state == LoadState.READING for ld in self.loads.active.values())
                only_reads = reading and not (self.lookups.pending_futures() or self.loads.pending_futures())
            if only_reads:
                self._sleep(IDLE_READ_WAIT_S)
        return self._build_connector_meta(scheduled)

    @_locked
    def _build_connector_meta(self, scheduled: Sequence[tuple[str, int, int]] | None) -> AdapterMetadata:
        self._ctx.step += 1
        if scheduled is not None and not scheduled:
            self._idle_wait()
        now = self._clock()
        if scheduled is not None:
            self.costs.steps.on_step(now, scheduled)
            self.loads.scheduled({req_id for req_id, _, _ in scheduled})
        self.return_held_blocks()
        self.gpu.serve()
        self.pressure.on_step()
        self.gpu.read_events()
        self._check_connection()
        self.holds.advance(now)  # answered holds first, then their ends (Holds.take_lease_ends)
        self.holds.take_lease_ends()
        self.loads.advance(now)
        meta = AdapterMetadata(
            loads=self.loads.take_specs(),
            commits=self.loads.take_commits(),
            frees=self._ctx.take_frees(),
            stores=self.stores.take_specs(),
            digests=self._ctx.take_digests(),
            # Engines that registered anew: the workers drop their old agents before any read.
            generations=self._take_generations(clear=True),
        )
        self._report_load()
        self._publish_stats()
        return meta

    def _take_generations(self, clear: bool = False) -> list[NewGeneration]:
        """The link's news of engines registered anew, added to those not yet sent; with `clear`,
        all of them, handed over."""
        if self.link is not None:
            self._generations.extend(self.link.take_generations())
        out = self._generations
        if clear:
            self._generations = []
        return out

    def _idle_wait(self) -> None:
        """A step that scheduled nothing. vLLM steps again at once while its requests wait on
        us, and that loop keeps the GIL from the broker session's thread, which must run for
        the answers they wait for (a lookup took 220 ms over 122 empty steps). Wait for one
        of those answers, up to IDLE_WAIT_S, with the GIL released."""
        pending = self.lookups.pending_futures() + self.loads.pending_futures()
        if pending:
            futures_wait(pending, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)

    def _wait_for_answers(self, *, in_output: bool) -> None:
        """Wait up to ``step_wait_ms`` for the broker answers a pull needs in this step
        (Loads.answers_due_now), without the lock: the session thread that delivers them may need it."""
        with self._lock:
            due = self.loads.answers_due_now(in_output=in_output)
        if due and self.config.step_wait_ms > 0:
            futures_wait(due, timeout=self.config.step_wait_ms / 1000.0)

    def update_connector_output(
        self,
        *,
        worker_meta: Any,
        finished_sending: set[str] | None,
        finished_recving: set[str] | None,
    ) -> set[str]:
        """A step's output. Returns the requests whose loads finished in it on this side (their
        reads done and, for a pull, the release answered within ``step_wait_ms``): the caller adds
        them to the output's finished_recving, so vLLM schedules their prefill in the next step."""
        with self._lock, self.loads.finishing_in_output():
            self._on_output(worker_meta, finished_sending, finished_recving)
        self._wait_for_answers(in_output=True)  # the releases of the reads that just finished
        with self._lock:
            with self.loads.finishing_in_output():
                self.loads.advance(self._clock())
            finished = self.loads.take_finished_now()
            self._publish_stats()
        return finished

    def _on_output(
        self, worker_meta: Any, finished_sending: set[str] | None, finished_recving: set[str] | None
    ) -> None:
        before = (self.costs.prefill.prefill_steps, self.costs.prefill.ready)
        self.costs.steps.on_output(self._clock())  # the step's forward pass is done: timed
        if (self.costs.prefill.prefill_steps, self.costs.prefill.ready) != before:
            # A prefill observed, or the model became ready: worth a stats write (a decode step is not).
            self.stats.dirty = True
        if isinstance(worker_meta, ReadOutcomes):
            self.loads.on_outcomes(worker_meta)
            self.stores.on_outcomes(worker_meta)
        for req_id in finished_recving or ():
            self.loads.received(req_id)
        for req_id in finished_sending or ():
            self.holds.sent(req_id)
        self.loads.step_done()
        self._publish_stats()

    @_locked
    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self.costs.steps.on_finished(self._clock(), req_id)
        self.own_load.finished(req_id)
        self.loads.failed.discard(req_id)
        self.lookups.request_finished(req_id)
        self.loads.request_finished(req_id)
        self._report_load()
        if self.loads.abort(req_id):
            # Aborted while loading: vLLM keeps its blocks until we report the
            # load finished; the protocol completes normally.
            return False, None
        self._cached_finished(request, block_ids)
        pin, params = self.holds.hold_finished(request, block_ids)
        # A CPU-tier copy keeps the request in vLLM (delay_free) until the copy is done;
        # the worker then reports it freed, unless a delay_free hold still needs it.
        storing = self.cpu is not None and self.stores.store_finished(
            request, block_ids, free_after_copy=pin is not HoldPin.DELAY_FREE
        )
        return pin is HoldPin.DELAY_FREE or storing, params

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()
        if self._stats_writer is not None:
            self._stats_writer.submit(self.stats_snapshot())  # once more: the final counts
            self._stats_writer.close()

    # ------------------------------------------------------------------
    # the broker session's thread
    # ------------------------------------------------------------------

    def pin_blocks(self, command: pb.PinCommand) -> pb.PinResult | Future[pb.PinResult]:
        """Broker PinCommand (session thread): pin CPU-tier slots now, or cached GPU blocks
        on the scheduler thread's next step (a Future)."""
        if command.lease.tier == pb.TIER_GPU and self.gpu.bound:
            return self.gpu.pin(command)
        with self._lock:
            result = self.stores.pin(command)
        if result.ok and self.config.verify_bytes:
            self.gpu.wake_engine()  # the next step states the pinned slots' digests
        return result

    def unpin_blocks(self, lease_id: str) -> None:
        """A lease ended (session thread): its CPU-tier slots may be evicted again, its GPU blocks freed."""
        self.gpu.unpin(lease_id)
        with self._lock:
            self.stores.unpin(lease_id)

    def _cached_finished(self, request: Any, block_ids: Sequence[int]) -> None:
        """Announce the finished request's blocks that vLLM's prefix cache now has."""
        link = self.link
        if not self.gpu.bound or link is None or not link.layout_id:
            return
        n = holdable_blocks(
            request.num_computed_tokens, len(request.block_hashes), len(block_ids), self.block_size
        )
        if n:
            self.gpu.cached_from_request(
                self._ctx.namespace(request), request.block_hashes[:n], block_ids[:n]
            )

    def _report_load(self) -> None:
        """Hand this engine's load to the broker link when it changed (own_load.py)."""
        load = self.own_load.changed(self.lookups.asked())
        if load is not None:
            self.stats.dirty = True
            if self.link is not None:
                self.link.set_load(load)

    def _check_connection(self) -> None:
        """Holds and lease pins live as long as the broker session they belong to.

        A broken stream does not end the session: a shared-state broker fleet
        resumes it on another replica with its leases (the same session id),
        and a reader may then still read what we hold, so freeing the blocks
        at the break could hand it reused blocks. They are given back once the
        session is known to be over: the engine registered a new session (its
        id changed; the old one's leases ended with it), or no stream came back
        within two session TTLs, by which time the broker has expired it. Only
        pins still waiting for this thread are refused at the break: their
        answer had no stream to go to.
        """
        link = self.link
        connected = link is not None and link.connected
        if connected:
            session_id = link.session_id if link is not None else ""
            if self._session_id and session_id != self._session_id:
                self._session_over("the engine registered a new broker session")
            self._session_id, self._lost_at = session_id, None
        elif self._was_connected:
            self._lost_at = self._clock()
            self.gpu.refuse_waiting_pins()
        elif self._lost_at is not None and self._clock() - self._lost_at > self._session_gone_s():
            self._session_over("broker session lost")
            self._lost_at = None
        self._was_connected = connected

    def _session_gone_s(self) -> float:
        return 2 * self._ctx.config.session_ttl_ms / 1000.0

    def _session_over(self, why: str) -> None:
        # The broker ended our leases with the session: nobody can claim these blocks.
        self.holds.free_all(why)
        if self.gpu.bound:
            self.gpu.unpin_all()
        if self.cpu is not None:
            self.cpu.unpin_all(keep_prefix=LOCAL_PIN_PREFIX)

    # ------------------------------------------------------------------
    # stats
    # ------------------------------------------------------------------

    @_locked
    def take_stats_delta(self) -> dict[str, Any] | None:
        """For vLLM's connector stats: the counts since the last call (None: nothing new)."""
        held_requests, held_blocks = self.holds.live()
        return self.stats.take_delta({"held_requests": held_requests, "held_blocks": held_blocks})

    @_locked
    def stats_snapshot(self) -> dict[str, Any]:
        snapshot = self.stats.as_dict(*self.holds.live())
        snapshot["load"] = self.own_load.value(self.lookups.asked())
        snapshot["cost_model"] = self.costs.snapshot(self._clock())
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
