"""Pull or recompute, from predicted times (``adaptive``) or the fixed threshold (``threshold``).

``choose`` is what the scheduler side calls each time vLLM asks about a
request. With ``pull_policy = threshold``, or while the cost model has not yet
seen enough engine steps to predict a prefill, it is decisions.decide_pull
(pull when the remote part has at least ``kv_recompute_threshold`` tokens).

With ``adaptive`` it predicts the time to the request's first token for every
way of serving the prompt and takes the quickest, counting with
``recompute_neighbour_cost`` what each way's computing costs the requests
already running on this engine (they wait while it computes; while a pull
waits for its lease and read, the engine keeps stepping for them):

- recompute everything beyond the local hit: prefill(N - L new, after L);
- for each holder (a GPU holder, a CPU tier, this engine's own CPU tier) and
  each block boundary k it covers: pull blocks [L, k) from it, then prefill
  the rest: pull(holder, tier, k - L blocks) + prefill(N - k new, after k).
  A holder that covers only part of the prompt, or whose pull pays only for
  part, is taken for that part (partial coverage).

A pull's bandwidth part is scaled by (1 + reads already in flight from that
holder): they share it. Those are this engine's own pulls from it, or, when
the broker answered, every reader's leases on it being read
(``HolderMatch.reads_in_flight``), whichever is more. The whole pull is scaled by the holder's load factor
(1 + slope * the load the broker or the mirror names for it, cost_model.py),
so a busy holder is pulled from less, and again as soon as it reports itself
idle. Pure: the cost model is read, never updated, so
``get_num_new_matched_tokens`` stays free of side effects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from kvbroker.engine_adapter.cost_model import CostModel, PullEstimate
from kvbroker.engine_adapter.decisions import SKIP_NO_HOLDER, Decision, PullPlan, decide_pull
from kvbroker.v1 import broker_pb2 as pb

POLICY_ADAPTIVE = "adaptive"
POLICY_THRESHOLD = "threshold"
POLICIES = (POLICY_ADAPTIVE, POLICY_THRESHOLD)

# Skip reason when the predicted recompute is quicker than any pull.
SKIP_COST = "recompute_cheaper"

DECIDED_BY_MODEL = "model"
DECIDED_BY_FALLBACK = "fallback"
# Why the fixed rule decided: the engine is configured (or the request asks) for it; the
# model had no prefill timing yet while a pull was possible; nothing to weigh (no pull possible).
FALLBACK_POLICY = "threshold_policy"
FALLBACK_NO_TIMING = "no_prefill_timing"
FALLBACK_NOTHING = "nothing_to_weigh"


@dataclass(frozen=True)
class Costs:
    """What the decision was made from; on the trace span and in the stats."""

    policy: str  # "adaptive", "threshold", or "threshold_until_observed"
    predicted_pull_ms: float = 0.0  # best pull option, to the first token (0: none)
    predicted_recompute_ms: float = 0.0  # recomputing everything beyond the local hit
    pull_bandwidth_gbps: float = 0.0  # of the chosen (or best) holder and tier
    pull_observations: int = 0  # that holder's and tier's observed pulls (0: prior)
    holder_load: float = 0.0  # the load named for the chosen (or best) holder
    pull_load_factor: float = 1.0  # what that load multiplied its predicted pull by
    holder_reads: int = 0  # reads of that holder in flight, its bandwidth shared with them
    # Who decided: "model" (predicted times) or "fallback" (the fixed rule), and why the fallback.
    decided_by: str = DECIDED_BY_MODEL
    fallback_reason: str = ""  # FALLBACK_* ("" when the model decided)
    prefill_source: str = ""  # whose timings predicted the prefill (CostModel.prefill_source)

    def attributes(self) -> dict[str, float | str | int]:
        return {
            "kvbroker.pull_policy": self.policy,
            "kvbroker.decided_by": self.decided_by,
            "kvbroker.fallback_reason": self.fallback_reason,
            "kvbroker.prefill_source": self.prefill_source,
            "kvbroker.predicted_pull_ms": round(self.predicted_pull_ms, 3),
            "kvbroker.predicted_recompute_ms": round(self.predicted_recompute_ms, 3),
            "kvbroker.pull_bandwidth_gbps": round(self.pull_bandwidth_gbps, 3),
            "kvbroker.pull_observations": self.pull_observations,
            "kvbroker.holder_load": round(self.holder_load, 3),
            "kvbroker.pull_load_factor": round(self.pull_load_factor, 3),
            "kvbroker.holder_reads": self.holder_reads,
        }


@dataclass(frozen=True)
class Choice:
    decision: Decision
    costs: Costs


def choose(
    *,
    policy: str,
    model: CostModel,
    now: float,
    matches: Sequence[pb.HolderMatch],
    self_engine_id: str,
    num_prompt_tokens: int,
    num_local_tokens: int,
    block_size: int,
    threshold_tokens: int,
    preferred_holder: str = "",
    local_cpu_blocks: int = 0,
    pulls_in_flight: Mapping[str, int] | None = None,
    running: float = 0.0,
    neighbour_cost: float = 0.0,
) -> Choice:
    rule = partial(
        decide_pull,
        matches=matches,
        self_engine_id=self_engine_id,
        num_prompt_tokens=num_prompt_tokens,
        num_local_tokens=num_local_tokens,
        block_size=block_size,
        preferred_holder=preferred_holder,
        local_cpu_blocks=local_cpu_blocks,
    )
    fixed = rule(threshold_tokens=threshold_tokens)
    if policy != POLICY_ADAPTIVE or not model.ready:
        if policy != POLICY_ADAPTIVE:
            name, why = POLICY_THRESHOLD, FALLBACK_POLICY
        else:
            possible = rule(threshold_tokens=0).plan is not None
            name, why = "threshold_until_observed", FALLBACK_NO_TIMING if possible else FALLBACK_NOTHING
        costs = Costs(
            name,
            holder_load=_load_of(matches, fixed.plan),
            decided_by=DECIDED_BY_FALLBACK,
            fallback_reason=why,
        )
        return Choice(fixed, costs)
    # The threshold rule has already settled the cases with nothing to weigh.
    plain = rule(threshold_tokens=0)
    recompute_s = model.prefill_s(num_prompt_tokens - num_local_tokens, num_local_tokens)
    if plain.plan is None:
        costs = Costs(
            POLICY_ADAPTIVE, predicted_recompute_ms=recompute_s * 1000.0, prefill_source=model.prefill_source
        )
        return Choice(plain, costs)
    return _cheapest(
        model=model,
        now=now,
        candidates=_candidates(matches, self_engine_id, local_cpu_blocks, plain.plan),
        num_prompt_tokens=num_prompt_tokens,
        num_local_tokens=num_local_tokens,
        block_size=block_size,
        recompute_s=recompute_s,
        in_flight=pulls_in_flight or {},
        tax=max(0.0, neighbour_cost) * max(0.0, running),
    )


def _load_of(matches: Sequence[pb.HolderMatch], plan: PullPlan | None) -> float:
    """The load named for the plan's holder (0 for none, or this engine's own CPU tier)."""
    if plan is not None:
        for m in matches:
            if m.engine_id == plan.holder_engine_id and m.tier == plan.tier:
                return m.load
    return 0.0


def _candidates(
    matches: Sequence[pb.HolderMatch], self_engine_id: str, local_cpu_blocks: int, preferred: PullPlan
) -> list[pb.HolderMatch]:
    """Every holder worth weighing: the one the fixed rule picked first (it wins ties), then others."""
    first = pb.HolderMatch(
        engine_id=preferred.holder_engine_id,
        tier=preferred.tier,  # type: ignore[arg-type]
        matched_blocks=0,
        hold_lease_id=preferred.hold_lease_id,
    )
    out: list[pb.HolderMatch] = []
    for m in matches:
        if m.engine_id == self_engine_id or m.matched_blocks <= 0:
            continue
        if m.engine_id == first.engine_id and m.tier == first.tier and m.hold_lease_id == first.hold_lease_id:
            first.matched_blocks, first.load = m.matched_blocks, m.load
            first.reads_in_flight = m.reads_in_flight
            continue
        out.append(m)
    if preferred.holder_engine_id == self_engine_id:
        first.matched_blocks = local_cpu_blocks
    if first.matched_blocks <= 0:
        first.matched_blocks = preferred.first_block + preferred.num_blocks
    return [first, *out]


def candidate_ends(lo: int, hi: int, num_prompt_tokens: int, block_size: int, chunk_tokens: int) -> list[int]:
    """The block ends [lo, hi] among which the quickest way to the first token lies, ascending.

    Pulling blocks up to ``end`` and computing the rest takes
    ``pull(end) + prefill(N - k new, after k)`` with k = the tokens covered. The
    pull is linear in k; the prefill is ``chunks * a + b * (N - k) + c * (N**2 - k**2) / 2``
    (the attention pairs of computing tokens k..N telescope to that, however they
    are chunked). So wherever the number of chunks stays the same, the total is
    concave in k and its minimum over a stretch of ends lies at one of the
    stretch's two ends. The stretches end where N - k crosses a multiple of the
    chunk size. Weighing those ends only keeps a decision O(prompt / chunk),
    not O(blocks): about two predictions per chunk of the prompt, not one per block.
    """
    if hi < lo:
        return []
    ends = {lo, hi}
    if chunk_tokens > 0:
        boundary = num_prompt_tokens - chunk_tokens
        while boundary > (lo - 1) * block_size:
            below = boundary // block_size  # covers at most the boundary: one chunk more to compute
            for end in (below, below + 1):
                if lo <= end <= hi:
                    ends.add(end)
            boundary -= chunk_tokens
    return sorted(ends)


def _cheapest(
    *,
    model: CostModel,
    now: float,
    candidates: list[pb.HolderMatch],
    num_prompt_tokens: int,
    num_local_tokens: int,
    block_size: int,
    recompute_s: float,
    in_flight: Mapping[str, int],
    tax: float = 0.0,
) -> Choice:
    """The quickest way to the first token; with ``tax`` (neighbour_cost x requests running here),
    each second this engine computes also costs ``tax`` seconds of the requests running beside it
    (a pull's wait does not: the engine keeps stepping for them meanwhile)."""
    local_blocks = num_local_tokens // block_size
    # (score, s, holder, end, est, reads)
    best: tuple[float, float, pb.HolderMatch, int, PullEstimate, int] | None = None
    for m in candidates:
        end_max = min(int(m.matched_blocks), -(-(num_prompt_tokens - 1) // block_size))
        # Reads of the holder now: this engine's own pulls, or every reader's as the broker
        # counts them (its count includes ours; a mirror's answer has none).
        share = 1 + max(in_flight.get(m.engine_id, 0), m.reads_in_flight)
        for end in candidate_ends(
            local_blocks + 1, end_max, num_prompt_tokens, block_size, model.chunk_tokens
        ):
            covered = min(end * block_size, num_prompt_tokens - 1)
            if covered <= num_local_tokens:
                continue
            est = model.pull(now, m.engine_id, int(m.tier), end - local_blocks, m.load)
            pull_s = est.fixed_s + (est.seconds - est.fixed_s) * share
            rest_s = model.prefill_s(num_prompt_tokens - covered, covered)
            total = pull_s + rest_s
            score = total + tax * rest_s
            if best is None or score < best[0]:
                best = (score, total, m, end, est, share - 1)
    if best is None:
        return Choice(
            Decision(None, SKIP_NO_HOLDER, "no holder covers a block beyond the local hit"),
            Costs(
                POLICY_ADAPTIVE,
                predicted_recompute_ms=recompute_s * 1000.0,
                prefill_source=model.prefill_source,
            ),
        )
    score, total, holder, end, est, reads = best
    costs = Costs(
        POLICY_ADAPTIVE,
        predicted_pull_ms=total * 1000.0,
        predicted_recompute_ms=recompute_s * 1000.0,
        pull_bandwidth_gbps=est.bandwidth_bps / 1e9,
        pull_observations=est.observations,
        holder_load=holder.load,
        pull_load_factor=est.load_factor,
        holder_reads=reads,
        prefill_source=model.prefill_source,
    )
    busy = f" at load {holder.load:g} (x{est.load_factor:.2f})" if holder.load > 0 else ""
    if reads:
        busy += f", {reads} other read{'s' if reads > 1 else ''} of it in flight"
    neighbours = ""
    if tax > 0:  # what each way's computing costs the requests running here, on top
        neighbours = f"; with the running requests' wait x{tax:g}: {recompute_s * (1 + tax) * 1000.0:.1f} vs {score * 1000.0:.1f} ms"
    if recompute_s * (1 + tax) <= score:
        detail = (
            f"recompute {recompute_s * 1000.0:.1f} ms <= pull from {holder.engine_id}{busy} "
            f"{total * 1000.0:.1f} ms (to the first token, predicted){neighbours}"
        )
        return Choice(Decision(None, SKIP_COST, detail), costs)
    remote_tokens = min(end * block_size, num_prompt_tokens - 1) - num_local_tokens
    plan = PullPlan(
        holder_engine_id=holder.engine_id,
        tier=int(holder.tier),
        hold_lease_id=holder.hold_lease_id,
        first_block=local_blocks,
        num_blocks=end - local_blocks,
        num_tokens=remote_tokens,
    )
    detail = (
        f"{remote_tokens} tokens from {holder.engine_id}{busy}: pull {total * 1000.0:.1f} ms < "
        f"recompute {recompute_s * 1000.0:.1f} ms (to the first token, predicted){neighbours}"
    )
    return Choice(Decision(plan, "pull", detail), costs)
