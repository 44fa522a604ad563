"""The placement's learned weights (clients/proxy/placement_learner.py): the fit recovers known
weights from timings, stays within its clamp, ignores answers that say nothing, and the proxy
feeds it from streamed answers (fake engines, real broker)."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from kvbroker.clients.proxy.placement_learner import PlacementLearner
from kvbroker.common.placement import DP_PULL, Placement, PlacementRule
from tests.clients.proxy.test_dp_routing import TURN2, chat, fleet  # noqa: F401 (fixture)

BASE = PlacementRule()


def _timings(
    learner: PlacementLearner, n: int, s_token: float, s_pull: float, s_request: float, s_fixed: float = 0.0
) -> None:
    """``n`` answers timed by the line the learner fits, with a little noise, some of them pulls."""
    rng = random.Random(7)
    for i in range(n):
        computed, load = rng.randrange(0, 2000), rng.randrange(0, 6)
        pulled = rng.randrange(100, 2000) if i % 3 == 0 else 0
        seconds = 0.05 + s_token * computed + s_pull * pulled + s_request * load + s_fixed * (pulled > 0)
        learner.observe(computed, pulled, load, seconds * rng.uniform(0.99, 1.01))


def test_the_fit_recovers_the_weights_the_timings_imply() -> None:
    learner = PlacementLearner(BASE)
    _timings(learner, 29, s_token=0.002, s_pull=0.0004, s_request=0.3)
    assert learner.rule() == BASE, "the settings hold until min_samples answers"
    _timings(learner, 200, s_token=0.002, s_pull=0.0004, s_request=0.3)
    rule = learner.rule()
    assert rule.busy_tokens == pytest.approx(150, rel=0.05)  # 0.3 s a request / 2 ms a token
    assert rule.pull_token_cost == pytest.approx(0.2, rel=0.05)
    assert rule.pull_fixed_tokens == BASE.pull_fixed_tokens / 8, "no fixed wait: as low as the clamp allows"
    assert (rule.min_prefix_tokens, rule.pull) == (BASE.min_prefix_tokens, BASE.pull)


def test_a_pulls_fixed_wait_is_learned() -> None:
    """Engines that share cores: every pull waits 0.3 s for the holder's steps, whatever its size
    (150 tokens at 2 ms a token), which the setting (160 tokens) did not know."""
    learner = PlacementLearner(BASE)
    _timings(learner, 200, s_token=0.002, s_pull=0.0004, s_request=0.3, s_fixed=0.3)
    rule = learner.rule()
    assert rule.pull_fixed_tokens == pytest.approx(150, rel=0.05)
    assert rule.pull_token_cost == pytest.approx(0.2, rel=0.05)
    learner = PlacementLearner(BASE)
    _timings(learner, 200, s_token=0.0003, s_pull=0.0, s_request=0.03, s_fixed=0.4)  # 1,333 tokens
    assert learner.rule().pull_fixed_tokens == BASE.pull_fixed_tokens * 8, "within the clamp"


def test_the_fixed_wait_needs_answers_that_did_not_pull() -> None:
    learner = PlacementLearner(BASE)
    for i in range(60):  # every answer pulled: the indicator never varied
        computed, pulled = 100 + 50 * i, 200 + 10 * (i % 7)
        learner.observe(computed, pulled, i % 5, 0.002 * computed + 0.0004 * pulled + 0.3 * (i % 5) + 0.5)
    assert learner.rule().pull_fixed_tokens == BASE.pull_fixed_tokens
    assert learner.rule().pull_token_cost == pytest.approx(0.2, rel=0.05)


def test_a_term_that_never_varied_is_not_learned() -> None:
    learner = PlacementLearner(BASE)
    for i in range(60):  # every engine idle: what a request in flight costs is unknown
        learner.observe(100 + 50 * i, 0, 0, 0.002 * (100 + 50 * i))
    assert learner.rule() == BASE


def test_learned_weights_stay_within_the_clamp() -> None:
    learner = PlacementLearner(BASE)
    _timings(learner, 100, s_token=0.001, s_pull=0.01, s_request=100.0)
    assert learner.rule().busy_tokens == BASE.busy_tokens * 8
    assert learner.rule().pull_token_cost == BASE.pull_token_cost * 8


def test_pull_cost_needs_answers_that_pulled() -> None:
    learner = PlacementLearner(BASE)
    for computed, load in [(100 + 50 * i, i % 5) for i in range(60)]:
        learner.observe(computed, 0, load, 0.002 * computed + 0.3 * load)
    assert learner.rule().busy_tokens == pytest.approx(150, rel=0.01)
    assert learner.rule().pull_token_cost == BASE.pull_token_cost
    assert learner.rule().pull_fixed_tokens == BASE.pull_fixed_tokens


def test_answers_that_say_nothing_are_not_learned_from() -> None:
    learner = PlacementLearner(BASE)
    placed = Placement((1, 0), DP_PULL, "", terms=((640, 0, 3.0), (128, 512, 0.0)))
    learner.served(placed, served_first=False, streamed=True, seconds=0.5)  # a failover served it
    learner.served(placed, served_first=True, streamed=False, seconds=0.5)  # first byte = last byte
    learner.served(placed, served_first=True, streamed=True, seconds=None)  # no first byte
    learner.served(placed, served_first=True, streamed=True, seconds=float("nan"))
    learner.served(Placement((0,), DP_PULL, ""), served_first=True, streamed=True, seconds=0.5)  # no terms
    PlacementLearner(BASE, learn=False).served(placed, served_first=True, streamed=True, seconds=0.5)
    assert learner.samples == 0
    learner.served(placed, served_first=True, streamed=True, seconds=0.5)
    assert (learner.samples, learner.pulls) == (1, 1), "the placed first engine's terms: it pulled"


async def _samples(fleet: dict[str, Any]) -> tuple[float, float]:  # noqa: F811
    async with fleet["http"].get(fleet["url"] + "/metrics") as resp:
        text = (await resp.read()).decode()
    samples = float(re.search(r"^kvbroker_proxy_placement_samples ([\d.]+)", text, re.M).group(1))  # type: ignore[union-attr]
    busy = float(re.search(r'placement_weight\{weight="busy_tokens"\} ([\d.]+)', text).group(1))  # type: ignore[union-attr]
    return samples, busy


@pytest.mark.parametrize("fleet", [{"placement_learn": True}], indirect=True)
async def test_the_proxy_learns_from_streamed_answers(fleet: dict[str, Any]) -> None:  # noqa: F811
    assert await _samples(fleet) == (0, BASE.busy_tokens)
    await chat(fleet, TURN2)  # not streamed: not learned from
    for _ in range(3):
        body = {"model": "tiny", "messages": TURN2, "max_tokens": 4, "stream": True}
        async with fleet["http"].post(fleet["url"] + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200 and resp.headers["X-KVBroker-Mode"] == "dp"
            await resp.read()
    assert await _samples(fleet) == (3, BASE.busy_tokens), "three answers: too few to move a weight"
