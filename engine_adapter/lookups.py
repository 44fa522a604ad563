"""Lookups of the scheduler side: who holds a new request's prefix, and pull or recompute.

The local index mirror answers in the step a request arrives; without a synced
mirror, or when the request's kv_transfer_params name a holder (P -> D), a
Resolve goes over the broker session and vLLM is told "ask again" until its
answer comes or ``resolve_wait_ms`` is used up (a ``Budget``, which loads.py
uses for ``acquire_wait_ms`` too). The decision itself is pull_policy.choose
(predicted costs, or the fixed threshold of decisions.decide_pull), made again
against the current local hit each time vLLM asks. A hold the router
named for a request that will not read it is declined here, so its holder
frees at once instead of at its TTL.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

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
    parse_transfer_params,
    prompt_tail,
    wire_hashes,
)
from kvbroker.engine_adapter.pull_policy import Costs, choose
from kvbroker.engine_adapter.scheduler_context import SchedulerContext, tier_name
from kvbroker.engine_adapter.topology import check_sizes
from kvbroker.engine_adapter.tracing import Span, end_span, start_span
from kvbroker.v1 import broker_pb2 as pb

# Under "vllm." so that vLLM's logging configuration prints our lines.
logger = logging.getLogger("vllm.kvbroker.scheduler")

# How often a lookup is re-asked while the router's hint says a holder should
# appear (its hold may reach the broker a moment after its answer reached us).
_HINT_RETRY_S = 0.02

# A wait on the broker counts at most this much of one gap between two checks: a
# longer gap means this process did not run (a stalled host) or ran one long model
# step, and the broker's answer may be waiting unread; that is not the broker's delay.
_MAX_COUNTED_GAP_S = 0.25


@dataclass
class Budget:
    """How long a wait on the broker may take, counted while this scheduler checks it."""

    limit_s: float
    last: float
    used_s: float = 0.0

    def left(self, now: float) -> float:
        """Seconds left after counting the time since the last check (capped at _MAX_COUNTED_GAP_S)."""
        self.used_s += min(max(0.0, now - self.last), _MAX_COUNTED_GAP_S)
        self.last = now
        return self.limit_s - self.used_s


@dataclass
class Lookup:
    request_id: str
    params: TransferParams
    namespace: pb.Namespace
    hashes: list[int]
    budget: Budget
    future: Future[pb.ResolveResponse] | None = None
    last_submit: float = 0.0
    response: pb.ResolveResponse | None = None
    last_response: pb.ResolveResponse | None = None
    num_local_tokens: int = 0
    decision: Decision | None = None
    costs: Costs | None = None  # what the last decision was made from
    logged: bool = False
    span: Span | None = None
    answered_by: str = "broker"  # or "mirror": the local index mirror answered at once
    # (monotonic s, scheduler step) the lookup began and was first decided: a pull's timeline.
    started_at: tuple[float, int] = (0.0, 0)
    decided_at: tuple[float, int] | None = None


# A hold the router named for a request: (holder engine id, the holder's request id).
NamedHold = tuple[str, str]


class Lookups:
    def __init__(self, ctx: SchedulerContext) -> None:
        self._ctx = ctx
        self._lookups: dict[str, Lookup] = {}
        # Requests whose kv_transfer_params name another engine's hold for them:
        # request id -> (holder, the holder's request id). Declined unless pulled from.
        self._named_holds: dict[str, NamedHold] = {}

    # ------------------------------------------------------------------
    # what the scheduler's hooks call
    # ------------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int, now: float) -> tuple[int | None, bool]:
        """get_num_new_matched_tokens for a request with no failed load behind it."""
        req_id = request.request_id
        lookup = self._lookups.get(req_id)
        if lookup is None:
            lookup = self._start(request, now)
            if lookup is None:
                return 0, False
        lookup.num_local_tokens = num_computed_tokens
        if lookup.decision is None:
            lookup.decision = self._poll(lookup, now)
            if lookup.decision is None:
                return None, False
        if lookup.decided_at is None:
            lookup.decided_at = (now, self._ctx.scheduling_step)
        # Re-decide against the current local hit (it may have grown since).
        decision = lookup.decision
        local_cpu = self._local_cpu_blocks(lookup)
        if lookup.response is not None or local_cpu:
            ctx = self._ctx
            params = lookup.params
            if params.holder_prefill is not None and params.holder_engine_id:
                # The holder timed the prefill this engine would recompute (cost_model.py).
                ctx.costs.seed_prefill(params.holder_engine_id, params.holder_prefill)
            choice = choose(
                policy=params.pull_policy or ctx.config.pull_policy,
                model=ctx.costs,
                now=now,
                matches=list(lookup.response.matches) if lookup.response is not None else [],
                self_engine_id=ctx.config.engine_id,
                num_prompt_tokens=request.num_tokens,
                num_local_tokens=num_computed_tokens,
                block_size=ctx.block_size,
                threshold_tokens=(
                    ctx.config.kv_recompute_threshold
                    if params.recompute_threshold is None
                    else params.recompute_threshold
                ),
                preferred_holder=params.holder_engine_id,
                local_cpu_blocks=local_cpu,
                pulls_in_flight=ctx.pulls_in_flight,
                running=ctx.own_load.running,
                neighbour_cost=ctx.config.recompute_neighbour_cost,
            )
            decision = lookup.decision = choice.decision
            lookup.costs = choice.costs
        self._log_decision(req_id, lookup, decision)
        if decision.plan is None:
            return 0, False
        return decision.plan.num_tokens, True

    def asked(self) -> int:
        """Requests vLLM asked about and has neither allocated nor finished (own_load.py)."""
        return len(self._lookups)

    def pending_futures(self) -> list[Future[Any]]:
        """Broker answers that undecided lookups wait for."""
        return [lk.future for lk in self._lookups.values() if lk.future is not None and not lk.future.done()]

    def pop(self, req_id: str) -> tuple[Lookup | None, NamedHold | None]:
        """vLLM has allocated for the request: its lookup and named hold are settled now."""
        return self._lookups.pop(req_id, None), self._named_holds.pop(req_id, None)

    def plan_after_alloc(
        self, req_id: str, lookup: Lookup | None, named: NamedHold | None, num_external_tokens: int
    ) -> PullPlan | None:
        """The plan to load, if vLLM took external tokens; declines a named hold not pulled from."""
        decision = lookup.decision if lookup is not None and num_external_tokens else None
        plan = decision.plan if decision is not None else None
        if named is not None and (plan is None or plan.holder_engine_id != named[0]):
            self.decline(req_id, named, lookup.decision if lookup is not None else None)
        if lookup is None:
            return None
        return plan

    def request_finished(self, req_id: str) -> None:
        """The request ended before vLLM allocated for it (or after): drop its lookup."""
        named = self._named_holds.pop(req_id, None)
        if named is not None:
            self.decline(req_id, named, None)  # finished (aborted) before it was scheduled
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None and lookup.span is not None:
            end_span(lookup.span, {"kvbroker.decision": "request_finished_before_decision"})

    def decline(self, req_id: str, named: NamedHold, decision: Decision | None) -> None:
        """We will not read the hold the router named for us: its holder frees it now, not at its TTL."""
        holder, hold_request_id = named
        why = decision.reason if decision is not None and decision.plan is None else "not pulled from it"
        self._ctx.stats.count("holds_declined")
        link = self._ctx.link
        if link is None or not link.connected:
            return  # the hold ends by its TTL; nothing else can end it
        logger.info(
            "kvbroker: request %s: declining %s's hold of request %s (%s)",
            req_id,
            holder,
            hold_request_id,
            why,
        )
        link.decline(holder, hold_request_id, f"reader {self._ctx.config.engine_id}: {why}")

    # ------------------------------------------------------------------
    # one lookup
    # ------------------------------------------------------------------

    def _start(self, request: Any, now: float) -> Lookup | None:
        ctx = self._ctx
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
                reader_tp=ctx.tp_size,
                holder_tp=params.holder_tp_size,
                reader_pp=ctx.pp_size,
                holder_pp=params.holder_pp_size or 1,
            )
            if mismatch is not None:
                self._skip(
                    req_id, SKIP_INCOMPATIBLE, f"holder {params.holder_engine_id}: {mismatch}; recomputing"
                )
                return None
        link = ctx.link
        broker_up = link is not None and link.connected and bool(link.layout_id)
        if not broker_up and (ctx.cpu is None or link is None or not link.layout_id):
            self._skip(req_id, SKIP_NO_BROKER, "broker unreachable; recomputing")
            return None
        hashes = wire_hashes(request.block_hashes)
        if not hashes:
            return None  # shorter than one block: nothing anyone could hold
        if params.do_remote_prefill and params.holder_engine_id:
            # P holds the prompt's last, partial block too (holds.py): ask for it.
            tail = prompt_tail(request, request.num_tokens, ctx.block_size)
            if tail is not None and tail[0] == len(hashes):
                hashes.append(tail[1])
        lookup = Lookup(
            request_id=req_id,
            params=params,
            namespace=ctx.namespace(request),
            hashes=hashes,
            budget=Budget(ctx.config.resolve_wait_ms / 1000.0, now),
            started_at=(now, ctx.scheduling_step),
        )
        lookup.span = start_span(
            "kvbroker.resolve",
            params.trace_context,
            {
                "kvbroker.request_id": req_id,
                "kvbroker.engine_id": ctx.config.engine_id,
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
        if ctx.config.index_mirror and self._answer_from_mirror(lookup):
            return lookup
        self._submit_resolve(lookup, now)
        return lookup

    def _answer_from_mirror(self, lookup: Lookup) -> bool:
        """Decide from the local index mirror, in this step, when it can answer.

        It cannot while unsynced. Requests whose kv_transfer_params name a holder
        (P -> D) still ask the broker: its answer carries the id of the hold lease
        to claim, which the mirror does not know, so P's blocks are freed the
        moment this engine has read them."""
        assert self._ctx.link is not None
        if lookup.params.holder_engine_id:
            return False
        matches = self._ctx.link.mirror_resolve(lookup.namespace, lookup.hashes)
        if matches is None:
            return False
        lookup.response = lookup.last_response = pb.ResolveResponse(matches=matches)
        lookup.decision = Decision(None, "resolved")
        lookup.answered_by = "mirror"
        self._ctx.stats.count("mirror_answers")
        return True

    def _submit_resolve(self, lookup: Lookup, now: float) -> None:
        assert self._ctx.link is not None
        lookup.future = self._ctx.link.resolve(
            lookup.namespace,
            lookup.hashes,
            acquire=False,
            lease_ttl_ms=0,
            min_blocks=0,
            request_id=lookup.request_id,
        )
        lookup.last_submit = now

    def _poll(self, lookup: Lookup, now: float) -> Decision | None:
        budget_left = lookup.budget.left(now)
        future = lookup.future
        hint = lookup.params.holder_engine_id
        if future is not None and future.done():
            error = future.exception()
            if error is not None:
                return Decision(None, SKIP_ERROR, f"resolve failed: {error}; recomputing")
            response = future.result()
            lookup.last_response = response
            if not hint or _hold_named(response, hint, bool(lookup.params.hold_request_id)):
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
                None,
                SKIP_TIMEOUT,
                f"no broker answer within resolve_wait_ms={self._ctx.config.resolve_wait_ms}",
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

    def _local_cpu_blocks(self, lookup: Lookup) -> int:
        """How much of the request's chain this engine's own CPU tier can restore."""
        cpu = self._ctx.cpu
        if cpu is None:
            return 0
        ns = lookup.namespace
        return cpu.ready_prefix([(ns.layout_id, ns.tenant, h) for h in lookup.hashes])

    def _log_decision(self, req_id: str, lookup: Lookup, decision: Decision) -> None:
        if lookup.logged:
            return
        lookup.logged = True
        plan = decision.plan
        costs = lookup.costs
        if costs is not None:
            self._record_costs(costs, pulled=plan is not None)
        end_span(
            lookup.span,
            {
                **(costs.attributes() if costs is not None else {}),
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
                tier_name(decision.plan.tier),
            )

    def _record_costs(self, costs: Costs, *, pulled: bool) -> None:
        """The decision's inputs in the stats: a count per policy and outcome, the latest figures."""
        stats = self._ctx.stats
        stats.count(f"decided_{'pull' if pulled else 'recompute'}_{costs.policy}")
        # Which decisions the cost model made and which the fixed rule made, and why.
        stats.count(f"decisions_by_{costs.decided_by}")
        if costs.fallback_reason:
            stats.count(f"fallback_{costs.fallback_reason}")
        for key, value in costs.attributes().items():
            stats.figure("last_" + key.removeprefix("kvbroker."), value)

    def _skip(self, req_id: str, reason: str, detail: str) -> None:
        self._ctx.stats.skip(reason)
        level = (
            logging.WARNING if reason in (SKIP_BAD_PARAMS, SKIP_ERROR, SKIP_INCOMPATIBLE) else logging.INFO
        )
        logger.log(level, "kvbroker: request %s: not pulling (%s): %s", req_id, reason, detail)


def _hold_named(response: pb.ResolveResponse, hint: str, hold_named: bool) -> bool:
    """The broker names the hinted holder, and its hold when the router named one.

    P's hold reaches the broker a moment after P's answer reached the router;
    until then the broker may name P for its cached full blocks only, without
    the hold that also covers the prompt's partial last block.
    """
    for m in response.matches:
        if m.engine_id == hint:
            return bool(m.hold_lease_id) or not hold_named
    return False
