"""A holder's load in the pull-or-recompute decision, and this engine's own load report."""

from __future__ import annotations

import pytest

from kvbroker.engine_adapter import cost_model
from kvbroker.engine_adapter.metadata import ReadOutcomes
from kvbroker.engine_adapter.pull_policy import SKIP_COST
from kvbroker.v1 import broker_pb2 as pb
from tests.engine_adapter.fakes import FakeRequest, holder_info
from tests.engine_adapter.scheduler_util import lease_for, make, resolved
from tests.engine_adapter.test_pull_policy import BIG, MB, decide, held, step_seconds, trained


def loaded(blocks: int, load: float, engine: str = "holder") -> pb.HolderMatch:
    m = held(blocks, engine)
    m.load = load
    return m


def test_prior_slope_stretches_a_pull_from_a_busy_holder() -> None:
    model = trained(**BIG)
    idle = decide(model, tokens=140, matches=[loaded(4, 0)])
    busy = decide(model, tokens=140, matches=[loaded(4, 8)])
    assert idle.costs.pull_load_factor == 1.0 and idle.costs.holder_load == 0
    assert busy.costs.holder_load == 8
    assert busy.costs.pull_load_factor == pytest.approx(1 + cost_model.PRIOR_LOAD_SLOPE * 8)
    prefill_rest = model.prefill_s(140 - 128, 128) * 1000.0
    idle_pull = idle.costs.predicted_pull_ms - prefill_rest
    assert busy.costs.predicted_pull_ms - prefill_rest == pytest.approx(idle_pull * 1.8)
    attributes = busy.costs.attributes()
    assert attributes["kvbroker.holder_load"] == 8 and attributes["kvbroker.pull_load_factor"] == 1.8


def test_busy_holder_moves_to_recompute_and_back_when_idle_again() -> None:
    model = trained(**BIG)
    now = 0.0

    def observe(seconds: float, load: float, n: int) -> None:
        nonlocal now
        for _ in range(n):
            now += 1.0
            model.pull_started("holder", load)
            model.observe_pull(now, "holder", pb.TIER_GPU, 4, 4 * MB, seconds)

    def pulls(load: float) -> bool:
        return decide(model, tokens=140, matches=[loaded(4, load)], now=now).decision.plan is not None

    observe(0.02, 0, 5)  # idle: 20 ms
    assert pulls(0) and pulls(8), "the prior slope alone does not outweigh a 300 ms prefill"
    observe(0.5, 8, 5)  # busy with 8 requests: 500 ms for the same pull
    slope = model.pulls.load_slope(now, "holder", pb.TIER_GPU)
    assert slope == pytest.approx((0.5 / 0.02 - 1) / 8, rel=0.15), "learned from the busy pulls"
    choice = decide(model, tokens=140, matches=[loaded(4, 8)], now=now)
    assert choice.decision.reason == SKIP_COST
    assert choice.costs.holder_load == 8 and choice.costs.pull_load_factor > 15
    assert "at load 8" in choice.decision.detail
    # Idle again: its next answer says load 0, and the idle estimate is back at once (no fading).
    assert pulls(0)
    idle = decide(model, tokens=140, matches=[loaded(4, 0)], now=now)
    assert idle.costs.predicted_pull_ms - model.prefill_s(12, 128) * 1000.0 == pytest.approx(20, rel=0.2), (
        "the busy pulls did not make the idle estimate slow"
    )


def test_a_quiet_holder_wins_over_a_busy_one() -> None:
    model = trained(**BIG)
    for i in range(5):
        model.pull_started("busy", 6)
        model.observe_pull(float(i), "busy", pb.TIER_GPU, 4, 4 * MB, 0.3)
        model.observe_pull(float(i), "quiet", pb.TIER_GPU, 4, 4 * MB, 0.03)
    choice = decide(model, tokens=140, matches=[loaded(4, 6, "busy"), loaded(4, 0, "quiet")], now=5.0)
    plan = choice.decision.plan
    assert plan is not None and plan.holder_engine_id == "quiet"


def test_threshold_decisions_record_the_holder_load_too() -> None:
    model = trained(**BIG)
    choice = decide(model, tokens=140, matches=[loaded(4, 3)], policy="threshold")
    assert choice.decision.plan is not None and choice.costs.holder_load == 3


def test_scheduler_reports_its_load_and_observes_pulls_at_the_holder_load() -> None:
    sched, link, clock = make(threshold=10_000)
    for tokens, context in [(300, 0), (1, 300), (900, 0), (1, 900), (2000, 0), (1, 2000)]:
        sched.build_connector_meta([("warm", tokens, context)])
        clock.advance(step_seconds(tokens, context, **BIG))
        # A step is timed from its schedule to its output (cost_model: compute, never idle time).
        sched.update_connector_output(worker_meta=None, finished_sending=None, finished_recving=None)
    assert link.loads == [], "no request taken up yet: nothing to report"

    r1, r2 = FakeRequest("r1", num_tokens=140), FakeRequest("r2", num_tokens=140)
    assert sched.get_num_new_matched_tokens(r1, 0) == (None, False)
    assert sched.get_num_new_matched_tokens(r2, 0) == (None, False)
    sched.build_connector_meta([])
    assert link.loads == [2.0], "two requests asked about"
    resolved(link, loaded(4, 5))  # r2's lookup: a holder at load 5
    assert sched.get_num_new_matched_tokens(r2, 0) == (128, True)
    figures = sched.stats_snapshot()["figures"]
    assert figures["last_holder_load"] == 5 and figures["last_pull_load_factor"] == 1.5
    sched.update_state_after_alloc(r2, [7, 8, 9, 10, 11], 128)
    sched.build_connector_meta([])
    assert link.loads == [2.0], "allocated r2 still counts, once"
    link.named("acquire")[0].future.set_result(  # type: ignore[union-attr]
        pb.LeaseResponse(lease=lease_for(r2, 4, lease_id="hold-holder"), holder=holder_info())
    )
    sched.build_connector_meta([])
    clock.advance(0.2)
    sched.update_connector_output(
        worker_meta=ReadOutcomes(done={"r2": 1}, bytes_read={"r2": 4 * MB}),
        finished_sending=None,
        finished_recving=None,
    )
    link.named("release")[0].future.set_result(pb.Lease(lease_id="hold-holder", state=pb.LEASE_RELEASED))  # type: ignore[union-attr]
    sched.build_connector_meta([])
    sched.update_connector_output(worker_meta=None, finished_sending=None, finished_recving={"r2"})
    holder = sched.stats_snapshot()["cost_model"]["holders"]["holder/TIER_GPU"]
    assert holder["observations"] == 1
    assert holder["load_slope"] != cost_model.PRIOR_LOAD_SLOPE, "the pull at load 5 taught the slope"

    sched.request_finished(r1, [])
    assert link.loads == [2.0, 1.0]
    sched.request_finished(r2, [7, 8, 9, 10, 11])
    assert link.loads == [2.0, 1.0, 0.0], "idle again: reported at once"
    assert sched.stats_snapshot()["load"] == 0
