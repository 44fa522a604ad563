"""Score in placement order (broker/placement_order.py): the proxy's data-parallel rule for any
router, over a real broker on each state backend, and the rule's edges as pure functions."""

from __future__ import annotations

import grpc
import pytest

from kvbroker.broker.errors import InvalidArgument
from kvbroker.broker.placement_order import placed, placement_rule
from kvbroker.common.hashing import wire_chain
from kvbroker.common.placement import DP_BALANCE, DP_HOLDER, DP_PULL, PlacementRule
from kvbroker.common.scoring import EngineScore
from kvbroker.v1 import broker_pb2 as pb
from tests.broker.test_api import Stub, code_of, pair

TOKENS = list(range(100, 100 + 32 * 20))  # 20 full blocks of 32 tokens


async def _busy_holder(stub: Stub, load: float) -> pb.Namespace:
    """P holds 16 of the prompt's 20 blocks and heartbeats `load`; D holds nothing, idle."""
    p, d, ns = await pair(stub)
    await p.announce(ns, pb.TIER_GPU, wire_chain(TOKENS, 32, "sha256")[:16])
    await p.send(heartbeat=pb.Heartbeat(load=load))
    await p.read_kind("heartbeat_ack")
    await d.send(heartbeat=pb.Heartbeat(load=0))
    await d.read_kind("heartbeat_ack")
    return ns


async def test_placement_sends_a_busy_holders_turn_to_a_free_engine_that_pulls(stub: Stub) -> None:
    ns = await _busy_holder(stub, load=8)
    prefix = await stub.Score(pb.ScoreRequest(namespace=ns, token_ids=TOKENS))
    assert [s.engine_id for s in prefix.scores] == ["P", "D"], "the default order is longest prefix first"
    assert prefix.placement_reason == "" and all(s.predicted_cost == 0 for s in prefix.scores)

    answer = await stub.Score(pb.ScoreRequest(namespace=ns, token_ids=TOKENS, order=pb.SCORE_ORDER_PLACEMENT))
    assert [s.engine_id for s in answer.scores] == ["D", "P"]
    assert (answer.placement_reason, answer.pull_from) == (DP_PULL, "P")
    d, p = answer.scores
    # D computes the 4 blocks nobody holds and pulls 16 (a pull's fixed 160 tokens, then a tenth
    # of a token each); P computes the same 4 blocks but waits behind 8 requests of 256
    # token-equivalents each, and they wait for its 128 tokens (1 each per request).
    assert d.predicted_cost == pytest.approx(4 * 32 + 160 + 0.1 * 16 * 32)
    assert p.predicted_cost == pytest.approx(4 * 32 + 8 * 256 + 8 * 4 * 32)
    assert (d.gpu_blocks, p.gpu_blocks, p.load) == (0, 16, 8), "counts and load are as in the prefix order"

    # Without pulls between engines D would recompute all 640 tokens: still quicker than the queue.
    no_pull = await stub.Score(
        pb.ScoreRequest(
            namespace=ns,
            token_ids=TOKENS,
            order=pb.SCORE_ORDER_PLACEMENT,
            weights=pb.PlacementWeights(no_pull=True),
        )
    )
    assert no_pull.scores[0].engine_id == "D" and no_pull.pull_from == ""
    assert no_pull.scores[0].predicted_cost == pytest.approx(640)
    # Make a request in flight cheap and the holder wins.
    cheap_load = await stub.Score(
        pb.ScoreRequest(
            namespace=ns,
            token_ids=TOKENS,
            order=pb.SCORE_ORDER_PLACEMENT,
            weights=pb.PlacementWeights(busy_tokens=1, neighbour_cost=0),
        )
    )
    assert cheap_load.scores[0].engine_id == "P" and cheap_load.placement_reason == DP_HOLDER


async def test_placement_weights_and_order_are_checked(stub: Stub) -> None:
    ns = await _busy_holder(stub, load=1)
    for weights, words in [
        (pb.PlacementWeights(busy_tokens=-1), "weights.busy_tokens"),
        (pb.PlacementWeights(busy_tokens=float("nan")), "weights.busy_tokens"),
        (pb.PlacementWeights(pull_token_cost=1e9), "weights.pull_token_cost"),
        (pb.PlacementWeights(min_prefix_tokens=1 << 30), "weights.min_prefix_tokens"),
        (pb.PlacementWeights(pull_fixed_tokens=-5), "weights.pull_fixed_tokens"),
        (pb.PlacementWeights(neighbour_cost=float("inf")), "weights.neighbour_cost"),
    ]:
        request = pb.ScoreRequest(namespace=ns, token_ids=TOKENS, order=pb.SCORE_ORDER_PLACEMENT)
        request.weights.CopyFrom(weights)
        code, message = await code_of(stub.Score(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in message, message
    code, message = await code_of(stub.Score(pb.ScoreRequest(namespace=ns, token_ids=TOKENS, order=7)))  # type: ignore[arg-type]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "SCORE_ORDER_PLACEMENT (1)" in message


def _score(engine_id: str, gpu: int, load: float, draining: bool = False, cpu: int = 0) -> EngineScore:
    return EngineScore(engine_id, gpu, cpu, load, draining)


def test_draining_engines_come_last_and_are_not_placed() -> None:
    scores = [_score("A", 10, 9, draining=True), _score("B", 0, 0), _score("C", 0, 1)]
    ordered, reasons = placed(scores, 20 * 32, 32, PlacementRule())
    assert [s.engine_id for s, _ in ordered] == ["B", "C", "A"]
    # A is draining, so nobody holds a prefix worth steering for: balance by load.
    assert reasons.placement_reason == DP_BALANCE
    only_draining, reasons = placed(scores[:1], 640, 32, PlacementRule())
    assert [s.engine_id for s, _ in only_draining] == ["A"] and "draining" in reasons.placement_detail


def test_cpu_tier_blocks_count_as_held() -> None:
    ordered, reasons = placed([_score("A", 0, 0), _score("B", 0, 0, cpu=18)], 20 * 32, 32, PlacementRule())
    assert ordered[0][0].engine_id == "B" and reasons.placement_reason == DP_HOLDER


def test_unset_weights_are_the_defaults() -> None:
    assert placement_rule(pb.PlacementWeights()) == PlacementRule()
    rule = placement_rule(
        pb.PlacementWeights(busy_tokens=10, pull_token_cost=0.5, min_prefix_tokens=1, no_pull=True)
    )
    assert rule == PlacementRule(busy_tokens=10, pull_token_cost=0.5, min_prefix_tokens=1, pull=False)
    # The two optional weights may be set to 0 (off), which an unset field cannot say.
    zero = placement_rule(pb.PlacementWeights(pull_fixed_tokens=0, neighbour_cost=0))
    assert (zero.pull_fixed_tokens, zero.neighbour_cost) == (0.0, 0.0)
    assert placement_rule(pb.PlacementWeights(neighbour_cost=2.5)).neighbour_cost == 2.5
    with pytest.raises(InvalidArgument, match=r"weights\.busy_tokens"):
        placement_rule(pb.PlacementWeights(busy_tokens=float("inf")))
