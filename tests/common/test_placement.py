"""Data-parallel placement (common/placement.py): load against locality, a pure function."""

from __future__ import annotations

from kvbroker.common.placement import (
    DP_BALANCE,
    DP_HOLDER,
    DP_NOT_SCORED,
    DP_PULL,
    DP_RECOMPUTE,
    DP_ROUND_ROBIN,
    Candidate,
    PlacementRule,
    place,
)

# The linear rule (no fixed pull cost, no cost to the neighbours): the tests of those terms say so.
RULE = PlacementRule(
    busy_tokens=256, pull_token_cost=0.1, min_prefix_tokens=64, pull_fixed_tokens=0, neighbour_cost=0
)


def names(candidates: list[Candidate], order: tuple[int, ...]) -> list[str]:
    return [candidates[i].name for i in order]


def test_an_idle_holder_keeps_its_prefix() -> None:
    engines = [Candidate("A", 512, 0), Candidate("B", 0, 0)]
    p = place(544, engines, RULE)
    assert names(engines, p.order) == ["A", "B"]
    assert p.reason == DP_HOLDER and not p.pull_from
    assert p.costs == (32.0, 32 + 0.1 * 512)


def test_a_busy_holder_sends_the_request_to_a_free_engine_that_pulls() -> None:
    engines = [Candidate("A", 512, 2), Candidate("B", 0, 0)]
    p = place(544, engines, RULE)
    assert names(engines, p.order) == ["B", "A"]
    assert p.reason == DP_PULL and p.pull_from == "A"
    assert "pulls 512 tokens from A" in p.detail and "holder A" in p.detail


def test_a_slightly_busy_holder_still_wins_when_the_pull_costs_more_than_its_queue() -> None:
    # One request ahead on A costs 256; pulling 4000 tokens costs 400.
    engines = [Candidate("A", 4000, 1), Candidate("B", 0, 0)]
    p = place(4032, engines, RULE)
    assert p.reason == DP_HOLDER and names(engines, p.order)[0] == "A"


def test_a_partial_holder_pulls_only_what_it_lacks() -> None:
    engines = [Candidate("A", 512, 3), Candidate("B", 256, 0), Candidate("C", 0, 0)]
    p = place(600, engines, RULE)
    assert names(engines, p.order)[0] == "B"
    assert p.reason == DP_PULL and p.pull_from == "A" and "pulls 256 tokens" in p.detail
    # C would pull all 512: dearer than B, cheaper than the busy holder.
    assert names(engines, p.order) == ["B", "C", "A"]


def test_a_gap_shorter_than_a_pulls_fixed_cost_is_recomputed_not_pulled() -> None:
    rule = PlacementRule(busy_tokens=256, pull_token_cost=0.1, pull_fixed_tokens=160, neighbour_cost=0)
    engines = [Candidate("A", 1152, 2), Candidate("B", 1024, 0)]
    p = place(1200, engines, rule)
    # B lacks 128 tokens: pulling them costs 160 + 12.8, computing them 128.
    assert names(engines, p.order)[0] == "B"
    assert p.reason == DP_RECOMPUTE and not p.pull_from
    assert p.terms[1] == (176, 0, 0.0) and p.costs[1] == 176.0
    # A longer gap is pulled: 512 tokens cost 160 + 51.2 against 512 to compute.
    far = [Candidate("A", 1536, 2), Candidate("B", 1024, 0)]
    p = place(1584, far, rule)
    assert p.reason == DP_PULL and p.pull_from == "A" and p.terms[1] == (48, 512, 0.0)
    assert abs(p.costs[1] - (48 + 160 + 51.2)) < 1e-9


def test_what_a_request_costs_the_requests_running_beside_it_keeps_a_turn_off_a_busy_engine() -> None:
    # B would recompute 128 tokens of A's history while 2 requests run there.
    engines = [Candidate("A", 1152, 3), Candidate("B", 1024, 2)]
    linear = PlacementRule(busy_tokens=256, pull_token_cost=0.1, pull_fixed_tokens=160, neighbour_cost=0)
    assert names(engines, place(1200, engines, linear).order)[0] == "B"  # 176 + 512 < 48 + 768
    social = PlacementRule(busy_tokens=256, pull_token_cost=0.1, pull_fixed_tokens=160, neighbour_cost=1)
    p = place(1200, engines, social)
    assert names(engines, p.order)[0] == "A" and p.reason == DP_HOLDER
    assert p.costs == (48 + 768 + 48 * 3, 176 + 512 + 176 * 2)
    # An idle engine has nobody to delay: the turn still leaves a busy holder for it.
    idle = [Candidate("A", 1152, 3), Candidate("B", 1024, 0)]
    assert names(idle, place(1200, idle, social).order)[0] == "B"


def test_a_prefill_queued_on_an_engine_delays_a_request_token_for_token() -> None:
    # Both hold the whole prompt and run nothing else, but A has 1,000 tokens still to compute.
    engines = [Candidate("A", 512, 1, backlog_tokens=1000), Candidate("B", 512, 1)]
    p = place(544, engines, RULE)
    assert names(engines, p.order) == ["B", "A"]
    assert p.costs == (32 + 1000 + 256, 32 + 256)


def test_without_pulls_a_busy_holder_loses_to_a_recompute_only_when_its_queue_is_longer() -> None:
    rule = PlacementRule(busy_tokens=256, pull_token_cost=0.1, min_prefix_tokens=64, pull=False)
    busy = [Candidate("A", 512, 3), Candidate("B", 0, 0)]
    p = place(544, busy, rule)
    assert names(busy, p.order)[0] == "B" and p.reason == DP_RECOMPUTE and not p.pull_from
    slightly = [Candidate("A", 512, 1), Candidate("B", 0, 0)]
    assert place(544, slightly, rule).reason == DP_HOLDER


def test_a_short_prefix_is_balanced_by_load_and_rotation() -> None:
    engines = [Candidate("A", 32, 0), Candidate("B", 0, 0), Candidate("C", 0, 1)]
    first = {names(engines, place(100, engines, RULE, rotation=r).order)[0] for r in range(3)}
    assert first == {"A", "B"}  # the rotation spreads ties; C is busier
    p = place(100, engines, RULE)
    assert p.reason == DP_BALANCE and "< 64" in p.detail
    assert names(engines, p.order)[-1] == "C"


def test_an_unscored_prompt_goes_to_the_least_loaded_engine() -> None:
    engines = [Candidate("A", 0, 2), Candidate("B", 0, 1)]
    p = place(None, engines, RULE, rotation=7)
    assert names(engines, p.order) == ["B", "A"] and p.reason == DP_NOT_SCORED


def test_held_tokens_beyond_the_prompt_count_as_the_whole_prompt() -> None:
    engines = [Candidate("A", 10_000, 0), Candidate("B", 0, 0)]
    p = place(500, engines, RULE)
    assert p.costs[0] == 0.0 and p.reason == DP_HOLDER


def test_equal_costs_go_to_the_less_loaded_then_rotate() -> None:
    # Both hold everything: cost is load only; equal loads rotate.
    engines = [Candidate("A", 512, 0), Candidate("B", 512, 0)]
    firsts = {names(engines, place(512, engines, RULE, rotation=r).order)[0] for r in range(2)}
    assert firsts == {"A", "B"}
    assert place(512, [Candidate("A", 512, 1), Candidate("B", 512, 0)], RULE).order[0] == 1


def test_no_candidates() -> None:
    assert place(10, [], RULE).order == ()


def test_round_robin_ignores_prefix_and_load() -> None:
    rule = PlacementRule(round_robin=True)
    engines = [Candidate("A", 512, 5), Candidate("B", 0, 0), Candidate("C", 0, 0)]
    firsts = [names(engines, place(544, engines, rule, rotation=r).order)[0] for r in range(3)]
    assert firsts == ["A", "B", "C"]
    assert place(544, engines, rule).reason == DP_ROUND_ROBIN
