"""Loads of the scheduler side: take the lease, have the worker read, release to commit.

A planned pull (lookups.py decided it) becomes a ``Load`` once vLLM has
allocated its blocks: ``acquiring`` (claim the holder's hold lease, or Resolve
with acquire) -> ``reading`` (a LoadSpec for every worker rank, which NIXL-READs
the holder's blocks) -> ``releasing`` -> done. Release commits the read: only
a released lease reports the blocks loaded; anything else (lease refused or not
granted within ``acquire_wait_ms``, incompatible holder, failed read, failed
release) commits them as failed and vLLM recomputes them. A restore from this
engine's own CPU tier needs no broker: a local pin keeps the slots while the
worker copies them back. In the fewest steps (``step_wait_ms``) a pull allocated
in step N is leased and read in N, released in N's output, and reported finished
to vLLM in that output (take_finished_now), so its prefill runs in step N+1.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvbroker.engine_adapter.decisions import PullPlan
from kvbroker.engine_adapter.lease_reads import holder_ranks, remote_block_ids
from kvbroker.engine_adapter.lookups import Budget, Lookup
from kvbroker.engine_adapter.metadata import Commit, LoadSpec, ReadOutcomes
from kvbroker.engine_adapter.pull_timeline import PullTimeline
from kvbroker.engine_adapter.scheduler_context import SchedulerContext, tier_name
from kvbroker.engine_adapter.topology import check_sizes
from kvbroker.engine_adapter.tracing import Span, current, end_span, start_span
from kvbroker.engine_adapter.verify import record_verification
from kvbroker.v1 import broker_pb2 as pb

# Under "vllm." so that vLLM's logging configuration prints our lines.
logger = logging.getLogger("vllm.kvbroker.scheduler")

# Pin id prefix of restores from our own CPU tier (no broker lease backs them).
LOCAL_PIN_PREFIX = "local:"


class LoadState(StrEnum):
    """Where a load is: acquiring -> reading -> releasing -> done (a str: logs print the word)."""

    ACQUIRING = "acquiring"
    READING = "reading"
    RELEASING = "releasing"
    DONE = "done"


@dataclass
class Load:
    request_id: str
    plan: PullPlan
    namespace: pb.Namespace
    hashes: list[int]
    local_block_ids: tuple[int, ...]
    started: float
    budget: Budget
    state: LoadState = LoadState.ACQUIRING
    future: Future[Any] | None = None
    lease: pb.Lease | None = None
    ranks_done: int = 0
    failure: str = ""
    bytes_read: int = 0
    aborted: bool = False
    span: Span | None = None
    # Restore from this engine's own CPU tier (no lease): the pin that keeps the slots.
    local_pin: str = ""
    # Decision -> first token, step by step (pull_timeline.py); the span stays open until then.
    timeline: PullTimeline = field(default_factory=PullTimeline)
    committed: bool = False  # the read was committed (released, or restored)


class Loads:
    def __init__(self, ctx: SchedulerContext) -> None:
        self._ctx = ctx
        # Loads until vLLM reports them received (finished_recving), done or not.
        self.active: dict[str, Load] = {}
        # Requests whose load failed: vLLM reschedules them to recompute, and asks us
        # again; they must not try the same load again (it may fail the same way).
        self.failed: set[str] = set()
        self._pending_specs: list[LoadSpec] = []
        self._pending_commits: list[Commit] = []
        # Committed loads whose remainder's prefill has not produced its first token yet.
        self._to_first_token: dict[str, Load] = {}
        # Set while a step's output is handled (update_connector_output): a load committed then
        # is reported finished to vLLM in that same output (take_finished_now), not through the
        # worker at the next step; a failed one still goes to the worker (its blocks' load errors).
        self.finish_in_output = False
        self._finished_now: set[str] = set()

    # ------------------------------------------------------------------
    # what the scheduler's hooks call
    # ------------------------------------------------------------------

    def start(
        self, lookup: Lookup, plan: PullPlan, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """vLLM allocated the request's blocks: take the lease (or the local pin) for the plan."""
        ctx = self._ctx
        req_id = lookup.request_id
        if plan.num_tokens != num_external_tokens:
            # vLLM trimmed the external part (e.g. a local sub-block tail); re-plan the block range.
            first = lookup.num_local_tokens // ctx.block_size
            end = -(-(lookup.num_local_tokens + num_external_tokens) // ctx.block_size)
            plan = PullPlan(
                plan.holder_engine_id, plan.tier, plan.hold_lease_id, first, end - first, num_external_tokens
            )
        local_ids = tuple(block_ids[plan.first_block : plan.first_block + plan.num_blocks])
        now = ctx.clock()
        load = Load(
            request_id=req_id,
            plan=plan,
            namespace=lookup.namespace,
            hashes=lookup.hashes,
            local_block_ids=local_ids,
            started=now,
            budget=Budget(ctx.config.acquire_wait_ms / 1000.0, now),
        )
        self.active[req_id] = load
        self._start_timeline(load, lookup)
        ctx.pulls_in_flight[plan.holder_engine_id] += 1
        load.span = start_span(
            "kvbroker.pull",
            lookup.params.trace_context,
            {
                "kvbroker.request_id": req_id,
                "kvbroker.blocks": plan.num_blocks,
                "kvbroker.tier": tier_name(plan.tier),
                "kvbroker.source_engine_id": plan.holder_engine_id,
                "kvbroker.destination_engine_id": ctx.config.engine_id,
                "kvbroker.hold_lease_id": plan.hold_lease_id,
            },
        )
        if len(local_ids) != plan.num_blocks:
            self._fail(load, f"vLLM allocated {len(local_ids)} blocks, expected {plan.num_blocks}")
            return
        if plan.holder_engine_id == ctx.config.engine_id:
            self._start_local_restore(load)
            return
        link = ctx.link
        if link is None or not link.connected:
            self._fail(load, "broker unreachable when the lease was to be taken")
            return
        if plan.hold_lease_id:
            with current(load.span):
                load.future = link.acquire(plan.hold_lease_id, ctx.config.lease_ttl_ms)
        else:
            end = plan.first_block + plan.num_blocks
            load.future = link.resolve(
                lookup.namespace,
                lookup.hashes[:end],
                acquire=True,
                lease_ttl_ms=ctx.config.lease_ttl_ms,
                min_blocks=end,
                request_id=req_id,
            )
        ctx.stats.count("leases_requested")
        load.timeline.time_answer(load.future, "lease_answer", "allocated", ctx.clock)

    def advance(self, now: float) -> None:
        """Check every load's pending broker call (a step of the scheduler)."""
        for load in list(self.active.values()):
            self._advance(load, now)

    def on_outcomes(self, outcomes: ReadOutcomes) -> None:
        """The worker ranks' read results; a load's reads are done when every rank reported."""
        self._ctx.stats.count("reads_refused_replaced_holder", outcomes.stale_refused)  # 0: not counted
        self._ctx.stats.count("holder_agents_replaced", outcomes.peers_replaced)
        # verify_bytes: counts, and each pull's span (a mismatch also fails the pull below).
        record_verification(self._ctx, outcomes, lambda r: getattr(self.active.get(r), "span", None))
        for req_id, reason in outcomes.failed.items():
            load = self.active.get(req_id)
            if load is not None and not load.failure:
                load.failure = reason
        for req_id, count in outcomes.done.items():
            load = self.active.get(req_id)
            if load is None or load.state != LoadState.READING:
                continue
            load.ranks_done += count
            load.bytes_read += outcomes.bytes_read.get(req_id, 0)
            if req_id in outcomes.read_s:
                ms = outcomes.read_s[req_id] * 1000.0
                load.timeline.extra_ms["worker_read"] = max(
                    ms, load.timeline.extra_ms.get("worker_read", 0.0)
                )
            if load.ranks_done >= self._ctx.expected_ranks:
                self._mark(load, "read_done")
                self._finish_reads(load)

    def received(self, req_id: str) -> None:
        """vLLM reports the request's load finished (finished_recving): a pull timeline mark.

        A committed load's time from allocation to here, what the request waited,
        is a pull observation of the cost model."""
        load = self.active.pop(req_id, None)
        if load is not None and load.committed and not load.aborted:
            ctx = self._ctx
            now = ctx.clock()
            ctx.costs.observe_pull(
                now,
                load.plan.holder_engine_id,
                load.plan.tier,
                load.plan.num_blocks,
                load.bytes_read,
                now - load.started,
            )
        waiting = self._to_first_token.get(req_id)
        if waiting is not None:
            self._mark(waiting, "load_finished")

    def scheduled(self, req_ids: Any) -> None:
        """This step computes these requests: a loaded one's remainder prefill starts now."""
        for req_id, load in self._to_first_token.items():
            if "load_finished" in load.timeline.marks and req_id in req_ids:
                self._mark(load, "prefill_scheduled")
                load.timeline.count_ready_steps(self._ctx.stats)

    def step_done(self) -> None:
        """A step's output came back: a prefill scheduled in it produced its first token."""
        for req_id, load in list(self._to_first_token.items()):
            if "prefill_scheduled" in load.timeline.marks:
                self._mark(load, "first_token")
                self._end_timeline(req_id, "")

    def request_finished(self, req_id: str) -> None:
        if req_id in self._to_first_token:
            self._end_timeline(req_id, "request finished before its first token")

    def abort(self, req_id: str) -> bool:
        """The request finished while loading; True if it was. The protocol completes normally:
        vLLM keeps its blocks until we report the load finished."""
        load = self.active.get(req_id)
        if load is None:
            return False
        load.aborted = True
        return True

    @contextmanager
    def finishing_in_output(self) -> Iterator[None]:
        """While a step's output is handled: loads committed now finish in it (take_finished_now)."""
        self.finish_in_output = True
        try:
            yield
        finally:
            self.finish_in_output = False

    def answers_due_now(self, *, in_output: bool) -> list[Future[Any]]:
        """Broker answers that let a pull go on in this step: the leases of loads allocated in the
        step being scheduled, or (``in_output``) the releases of reads that finished in its output."""
        if in_output:
            state, mark, step = LoadState.RELEASING, "read_done", self._ctx.step
        else:
            state, mark, step = LoadState.ACQUIRING, "allocated", self._ctx.scheduling_step
        return [
            ld.future
            for ld in self.active.values()
            if ld.state == state
            and ld.future is not None
            and ld.timeline.marks.get(mark, (0.0, -1))[1] == step
        ]

    def take_finished_now(self) -> set[str]:
        """Loads committed while this output was handled: vLLM is told in the same output."""
        done, self._finished_now = self._finished_now, set()
        for req_id in done:
            self.received(req_id)
        return done

    def pending_futures(self) -> list[Future[Any]]:
        """Broker answers (a lease, a release) that loads wait for."""
        return [ld.future for ld in self.active.values() if ld.future is not None and not ld.future.done()]

    def take_specs(self) -> list[LoadSpec]:
        specs, self._pending_specs = self._pending_specs, []
        return specs

    def take_commits(self) -> list[Commit]:
        commits, self._pending_commits = self._pending_commits, []
        return commits

    # ------------------------------------------------------------------
    # one load
    # ------------------------------------------------------------------

    def _advance(self, load: Load, now: float) -> None:
        if load.state == LoadState.ACQUIRING:
            future = load.future
            if future is None or not future.done():
                if load.budget.left(now) < 0:
                    self._fail(
                        load, f"lease not granted within acquire_wait_ms={self._ctx.config.acquire_wait_ms}"
                    )
                    if future is not None:
                        future.add_done_callback(self._release_abandoned)
                return
            error = future.exception()
            if error is not None:
                self._fail(load, f"lease refused: {error}")
                return
            self._start_reads(load, future.result())
        elif load.state == LoadState.RELEASING:
            future = load.future
            if future is None or not future.done():
                return
            error = future.exception()
            if error is not None:
                self._fail(load, f"release failed, the read is not committed: {error}")
                return
            self._commit(load, ok=True, reason="released")

    def _start_reads(self, load: Load, response: pb.ResolveResponse | pb.LeaseResponse) -> None:
        ctx = self._ctx
        lease = response.lease if response.HasField("lease") else None
        if lease is None or not lease.lease_id:
            skipped = getattr(response, "skipped_reason", "") or "no lease"
            self._fail(load, f"broker granted no lease ({skipped})")
            return
        load.lease = lease
        holder = response.holder
        reason = check_sizes(
            reader_tp=ctx.tp_size,
            holder_tp=holder.layout.tp_size or 1,
            reader_pp=ctx.pp_size,
            holder_pp=holder.layout.pp_size or 1,
        )
        if reason is None:
            remote_ids, reason = remote_block_ids(lease, load.hashes, load.plan)
        if reason is None:
            ranks, reason = holder_ranks(holder, lease.tier)
        if reason is not None:
            self._fail(load, f"holder {holder.engine_id or lease.holder_engine_id} incompatible: {reason}")
            return
        load.state = LoadState.READING
        self._mark(load, "lease_granted")
        if load.span is not None:
            # Which holder rank serves which layers, for the trace: "pp0/tp0:[0,2)".
            load.span.set_attribute(
                "kvbroker.source_ranks",
                ",".join(f"pp{r.pp_rank}/tp{r.tp_rank}:[{r.start_layer},{r.end_layer})" for r in ranks),
            )
            load.span.set_attribute("kvbroker.destination_ranks", ctx.tp_size * ctx.pp_size)
            load.span.set_attribute("kvbroker.lease_id", lease.lease_id)
            load.span.set_attribute("kvbroker.holder_generation", int(holder.generation))
        self._pending_specs.append(
            LoadSpec(
                request_id=load.request_id,
                lease_id=lease.lease_id,
                holder_engine_id=lease.holder_engine_id,
                tier=int(lease.tier),
                remote_block_ids=tuple(remote_ids),
                local_block_ids=load.local_block_ids,
                holder_ranks=tuple(ranks),
                holder_generation=int(holder.generation),
                block_hashes=tuple(load.hashes[load.plan.first_block :][: len(remote_ids)]),
            )
        )

    def _start_local_restore(self, load: Load) -> None:
        """Copy blocks back from our own CPU tier: no broker, no lease; a pin keeps the slots."""
        cpu = self._ctx.cpu
        assert cpu is not None
        plan, ns = load.plan, load.namespace
        chain = load.hashes[plan.first_block : plan.first_block + plan.num_blocks]
        pin = LOCAL_PIN_PREFIX + load.request_id
        slots = cpu.pin(pin, [(ns.layout_id, ns.tenant, h) for h in chain])
        if slots is None:
            self._fail(load, "the blocks left the CPU tier before they could be copied back")
            return
        load.local_pin = pin
        load.state = LoadState.READING
        self._pending_specs.append(
            LoadSpec(
                request_id=load.request_id,
                lease_id=pin,
                holder_engine_id=self._ctx.config.engine_id,
                tier=pb.TIER_CPU,
                remote_block_ids=tuple(slots),
                local_block_ids=load.local_block_ids,
                holder_ranks=(),
            )
        )

    def _unpin_local(self, load: Load) -> None:
        if load.local_pin and self._ctx.cpu is not None:
            self._ctx.cpu.unpin(load.local_pin)
        load.local_pin = ""

    def _finish_reads(self, load: Load) -> None:
        if load.local_pin:
            if load.failure:
                self._fail(load, f"copy from the CPU tier failed: {load.failure}")
            else:
                self._commit(load, ok=True, reason="restored")
            return
        link = self._ctx.link
        assert load.lease is not None and link is not None
        if load.failure:
            self._fail(load, f"NIXL read failed: {load.failure}")
            return
        load.state = LoadState.RELEASING
        with current(load.span):
            # What was read, for the broker's per-pair counters (the lease may cover more).
            read = (load.plan.num_blocks, load.bytes_read)
            load.future = link.release(load.lease.lease_id, load.lease.epoch, read)
        load.timeline.time_answer(load.future, "release_answer", "read_done", self._ctx.clock)

    def _fail(self, load: Load, reason: str) -> None:
        link = self._ctx.link
        if load.lease is not None and load.state != LoadState.RELEASING and link is not None:
            # End the lease at once so the holder frees; the bytes are not used either way
            # (nothing counts as read).
            link.release(load.lease.lease_id, load.lease.epoch, (0, 0))
        self._ctx.stats.count("pulls_failed")
        logger.warning(
            "kvbroker: request %s: pull of %d blocks from %s failed, recomputing them: %s",
            load.request_id,
            load.plan.num_blocks,
            load.plan.holder_engine_id,
            reason,
        )
        self._commit(load, ok=False, reason=reason)

    def _commit(self, load: Load, *, ok: bool, reason: str) -> None:
        stats = self._ctx.stats
        load.state = LoadState.DONE
        load.committed = ok
        ctx = self._ctx
        ctx.pulls_in_flight[load.plan.holder_engine_id] -= 1
        if ctx.pulls_in_flight[load.plan.holder_engine_id] <= 0:
            del ctx.pulls_in_flight[load.plan.holder_engine_id]
        self._unpin_local(load)  # every load ends here; a restore's slots may be evicted again
        elapsed_s = self._ctx.clock() - load.started
        self._mark(load, "committed")
        attributes: dict[str, Any] = {
            "kvbroker.lease_id": load.lease.lease_id if load.lease else "",
            "kvbroker.bytes": load.bytes_read,
            "kvbroker.duration_ms": elapsed_s * 1000.0,
            "kvbroker.gb_per_s": load.bytes_read / elapsed_s / 1e9 if elapsed_s > 0 else 0.0,
            "kvbroker.committed": ok,
            "kvbroker.skip_reason": "" if ok else reason,
        }
        if ok:
            # The span stays open until the remainder's first token (step_done).
            for key, value in attributes.items():
                if load.span is not None:
                    load.span.set_attribute(key, value)
            self._to_first_token[load.request_id] = load
        else:
            end_span(load.span, {**attributes, **load.timeline.attributes()}, error=reason)
            load.span = None
        if ok and load.plan.holder_engine_id == self._ctx.config.engine_id:
            stats.count("cpu_restores")
            stats.count("cpu_restored_blocks", load.plan.num_blocks)
            logger.info(
                "kvbroker: request %s: restored %d blocks (%d bytes) from this engine's CPU tier in %.1f ms",
                load.request_id,
                load.plan.num_blocks,
                load.bytes_read,
                elapsed_s * 1000.0,
            )
        elif ok:
            if load.lease is not None:
                stats.count(f"pulled_blocks_{tier_name(load.lease.tier).lower()}", load.plan.num_blocks)
            stats.count("pulls")
            stats.count("pulled_blocks", load.plan.num_blocks)
            # The tokens vLLM took as computed: a partial last block counts its own.
            stats.count("pulled_tokens", load.plan.num_tokens)
            stats.count("pulled_bytes", load.bytes_read)
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
            self.failed.add(load.request_id)
        if ok and self.finish_in_output and not load.aborted:
            # The worker's reads are done (it reported them) and nothing of it waits for the
            # commit: vLLM learns it from this output and schedules the prefill next step.
            self._finished_now.add(load.request_id)
            return
        self._pending_commits.append(Commit(load.request_id, ok, load.local_block_ids, reason))

    # ------------------------------------------------------------------
    # the timeline (pull_timeline.py)
    # ------------------------------------------------------------------

    def _start_timeline(self, load: Load, lookup: Lookup) -> None:
        t = load.timeline
        t.marks["lookup_started"] = lookup.started_at
        t.marks["decided"] = lookup.decided_at or lookup.started_at
        t.marks["allocated"] = (load.started, self._ctx.scheduling_step)

    def _mark(self, load: Load, name: str) -> None:
        load.timeline.mark(name, self._ctx.clock(), self._ctx.step, load.span)

    def _end_timeline(self, req_id: str, error: str) -> None:
        load = self._to_first_token.pop(req_id)
        end_span(load.span, load.timeline.attributes(), error=error)
        load.span = None
        logger.info("kvbroker: request %s: pull timeline: %s", req_id, load.timeline.describe())

    def _release_abandoned(self, future: Future[Any]) -> None:
        """A lease granted after we gave up on it: end it so the holder frees."""
        link = self._ctx.link
        if future.exception() is not None or link is None:
            return
        lease = future.result().lease
        if lease.lease_id:
            link.release(lease.lease_id, lease.epoch, (0, 0))  # nothing was read under it
