"""Score's placement order: the proxy's data-parallel rule, answered by the broker for any router.

A router that sets ``ScoreRequest.order = SCORE_ORDER_PLACEMENT`` gets the
engines in order of predicted time to first token (``common/placement.py``):
each engine's load (what it last heartbeat) against the prefix it holds (GPU or
CPU tier) and the cheaper pull of the longest prefix held elsewhere. Draining
engines are not placed: they come last, in the prefix order. The answer says
why the first engine is first, with the figures, and which engine it would
pull from, so a foreign router can log and act on the same reasons as ours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvbroker.broker import codec
from kvbroker.broker.errors import InvalidArgument
from kvbroker.broker.results import ScoreResult
from kvbroker.common.placement import Candidate, PlacementRule, place
from kvbroker.common.scoring import EngineScore
from kvbroker.v1 import broker_pb2 as pb

# Weights above these are a client's mistake, not a tuning: refused with their bounds.
MAX_BUSY_TOKENS = 1e7
MAX_PULL_TOKEN_COST = 100.0
MAX_PULL_FIXED_TOKENS = 1e7
MAX_NEIGHBOUR_COST = 1e4
MAX_MIN_PREFIX_TOKENS = 1 << 24


def placement_rule(weights: pb.PlacementWeights) -> PlacementRule:
    """The rule for ``weights`` (0 or unset: the default); InvalidArgument names a bad weight."""
    default = PlacementRule()
    checks = (
        ("busy_tokens", weights.busy_tokens, MAX_BUSY_TOKENS),
        ("pull_token_cost", weights.pull_token_cost, MAX_PULL_TOKEN_COST),
        ("pull_fixed_tokens", weights.pull_fixed_tokens, MAX_PULL_FIXED_TOKENS),
        ("neighbour_cost", weights.neighbour_cost, MAX_NEIGHBOUR_COST),
    )
    for name, value, bound in checks:
        if not math.isfinite(value) or value < 0 or value > bound:
            raise InvalidArgument(
                f"weights.{name} must be a number from 0 to {bound:g} (0: default); got {value!r}"
            )
    if weights.min_prefix_tokens > MAX_MIN_PREFIX_TOKENS:
        raise InvalidArgument(
            f"weights.min_prefix_tokens must be at most {MAX_MIN_PREFIX_TOKENS}; got {weights.min_prefix_tokens}"
        )
    return PlacementRule(
        busy_tokens=weights.busy_tokens or default.busy_tokens,
        pull_token_cost=weights.pull_token_cost or default.pull_token_cost,
        min_prefix_tokens=weights.min_prefix_tokens or default.min_prefix_tokens,
        pull=not weights.no_pull,
        pull_fixed_tokens=(
            weights.pull_fixed_tokens if weights.HasField("pull_fixed_tokens") else default.pull_fixed_tokens
        ),
        neighbour_cost=weights.neighbour_cost
        if weights.HasField("neighbour_cost")
        else default.neighbour_cost,
    )


def check_order(order: int) -> None:
    if order not in (pb.SCORE_ORDER_PREFIX, pb.SCORE_ORDER_PLACEMENT):
        raise InvalidArgument(
            f"order {order} is not a ScoreOrder: SCORE_ORDER_PREFIX (0) or SCORE_ORDER_PLACEMENT (1)"
        )


def score_answer(result: ScoreResult, request: pb.ScoreRequest) -> pb.ScoreResponse:
    """The Score answer in the order ``request`` asks for."""
    check_order(request.order)
    if request.order != pb.SCORE_ORDER_PLACEMENT:
        return codec.score_pb(result)
    rule = placement_rule(request.weights)
    num_tokens = len(request.token_ids) or result.total_blocks * result.block_size
    ordered, reasons = placed(result.scores, num_tokens, result.block_size, rule)
    answer = codec.score_pb(result)
    by_id = {s.engine_id: s for s in answer.scores}
    del answer.scores[:]
    for score, cost in ordered:
        out = answer.scores.add()
        out.CopyFrom(by_id[score.engine_id])
        out.predicted_cost = cost
    answer.MergeFrom(reasons)
    return answer


def placed(
    scores: Sequence[EngineScore], num_tokens: int, block_size: int, rule: PlacementRule
) -> tuple[list[tuple[EngineScore, float]], pb.ScoreResponse]:
    """``scores`` (prefix order) reordered by ``rule``, each with its predicted cost; and the
    answer's reason fields (a ScoreResponse holding only those)."""
    live = [s for s in scores if not s.draining]
    draining = [(s, 0.0) for s in scores if s.draining]
    if not live:
        return draining, pb.ScoreResponse(placement_detail="no engine that is not draining")
    candidates = [
        Candidate(s.engine_id, max(s.gpu_blocks, s.cpu_blocks) * block_size, max(0.0, s.load)) for s in live
    ]
    # Rotation 0: the prefix order (engine id among equals) breaks ties, so the answer is stable.
    placement = place(num_tokens, candidates, rule)
    costs = placement.costs or (0.0,) * len(live)
    ordered = [(live[i], costs[i]) for i in placement.order]
    reasons = pb.ScoreResponse(
        placement_reason=placement.reason, placement_detail=placement.detail, pull_from=placement.pull_from
    )
    return ordered + draining, reasons
