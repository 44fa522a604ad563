"""The cost model and the adaptive pull-or-recompute policy, from fake observations."""

from __future__ import annotations

import pytest

from kvbroker.engine_adapter import cost_model
from kvbroker.engine_adapter.config import AdapterConfig, AdapterConfigError
from kvbroker.engine_adapter.cost_model import CostModel, PrefillModel, StepTimer
from kvbroker.engine_adapter.metadata import ReadOutcomes
from kvbroker.engine_adapter.pull_policy import SKIP_COST, Choice, choose
from kvbroker.v1 import broker_pb2 as pb
from tests.engine_adapter.fakes import FakeRequest, holder_info
from tests.engine_adapter.scheduler_util import make, match, pull_to_reading, resolved

BS = 32
MB = 1_000_000


def step_seconds(tokens: int, context: int, a: float, b: float, c: float) -> float:
    """A made-up engine: a + b per token + c per attention pair."""
    return a + b * tokens + c * tokens * (context + tokens / 2)


def trained(a: float, b: float, c: float = 0.0, *, block_bytes: int = MB) -> CostModel:
    """A cost model that has watched an engine of these figures prefill and decode."""
    model = CostModel(block_bytes=block_bytes)
    now = 0.0
    for tokens, context in [(300, 0), (1, 300), (1, 301), (900, 0), (1, 900), (2000, 0), (64, 2000), (1, 64)]:
        now += 1.0
        model.prefill.observe(now, step_seconds(tokens, context, a, b, c), [(tokens, context)])
    return model


# Engines of the two kinds the policy must tell apart (figures of the order the
# CPU build shows): a 2-layer test model and a 30-layer 135M model.
TINY = {"a": 0.004, "b": 0.000025}
BIG = {"a": 0.030, "b": 0.0022, "c": 1e-7}


def decide(
    model: CostModel, *, tokens: int, matches: list[pb.HolderMatch], now: float = 10.0, **kw
) -> Choice:  # type: ignore[no-untyped-def]
    return choose(
        policy=kw.pop("policy", "adaptive"),
        model=model,
        now=now,
        matches=matches,
        self_engine_id="reader",
        num_prompt_tokens=tokens,
        num_local_tokens=kw.pop("local", 0),
        block_size=BS,
        threshold_tokens=kw.pop("threshold", 64),
        **kw,
    )


def held(blocks: int, engine: str = "holder", tier: int = pb.TIER_GPU) -> pb.HolderMatch:
    return pb.HolderMatch(engine_id=engine, tier=tier, matched_blocks=blocks, hold_lease_id=f"hold-{engine}")  # type: ignore[arg-type]


def test_prefill_model_learns_linear_and_attention_terms() -> None:
    model = trained(0.005, 0.00002, 1e-8)
    for tokens, context in [(100, 0), (4000, 0), (500, 3000)]:
        truth = step_seconds(tokens, context, 0.005, 0.00002, 1e-8)
        assert model.prefill_s(tokens, context) == pytest.approx(truth, rel=0.02)


def test_prefill_model_is_not_ready_on_decode_steps_alone() -> None:
    model = PrefillModel()
    for i in range(20):
        model.observe(float(i), 0.01, [(1, 100 + i)])
    assert not model.ready
    model.observe(21.0, 0.05, [(500, 0)])
    assert model.ready


def test_chunked_prefill_adds_a_step_per_chunk() -> None:
    model = trained(**TINY)
    one = model.prefill_s(4096, 0)
    model.chunk_tokens = 1024
    assert model.prefill_s(4096, 0) == pytest.approx(one + 3 * TINY["a"], rel=0.02)


def test_step_timer_times_schedule_to_output_never_idle_time() -> None:
    model = PrefillModel()
    timer = StepTimer(model)
    timer.on_step(0.0, [("r1", 100, 0)])
    timer.on_output(0.5)  # a prefill-only engine: r1 finished in this step, still timed
    assert (model.steps, model.prefill_steps) == (1, 1)
    timer.on_step(60.0, [("r2", 50, 0)])  # an idle minute between the two steps
    timer.on_output(60.2)
    assert model.steps == 2 and model.coefficients()[0] < 1.0, "an idle minute is not a step"
    timer.on_step(61.0, [])  # nothing scheduled: nothing to time
    timer.on_output(61.1)
    assert model.steps == 2


def test_step_timer_times_a_step_when_its_request_finishes_in_it() -> None:
    """A prefill-only engine: the request finishes while its step's output is handled, and its
    kv_transfer_params (built then) already carry the step's timing."""
    model = PrefillModel()
    timer = StepTimer(model)
    timer.on_step(0.0, [("r1", 500, 0)])
    timer.on_finished(0.4, "r2")  # not of that step: nothing timed
    assert model.steps == 0
    timer.on_finished(0.5, "r1")
    assert model.ready and model.steps == 1
    timer.on_step(0.6, [("r3", 1, 10)])
    timer.on_output(0.52)  # the first step's output call: timed already, the next step waits
    assert model.steps == 1
    timer.on_output(0.7)
    assert model.steps == 2


def test_step_timer_drops_a_step_whose_output_never_came() -> None:
    model = PrefillModel()
    timer = StepTimer(model)
    for t in (0.0, 10.0, 20.0):  # three steps scheduled, no output for the first
        timer.on_step(t, [("r", 1, 100)])
    timer.on_output(20.05)
    timer.on_output(20.1)
    assert model.steps == 2 and model.coefficients()[0] < 11.0


def test_decode_steps_are_no_prefill_steps() -> None:
    model = CostModel()
    for i in range(10):
        model.prefill.observe(float(i), 0.01, [(1, 100 + i), (1, 50)])
    snap = model.snapshot(10.0)
    assert snap["prefill_steps"] == 0 and snap["steps"] == 10 and snap["prefill_ready"] is False


def test_a_holders_timings_seed_a_decode_only_engine() -> None:
    p = trained(**BIG)
    d = CostModel(block_bytes=MB)
    for i in range(10):  # D only decodes: never ready on its own
        d.prefill.observe(float(i), 0.03, [(1, 2000 + i)])
    assert not d.ready
    d.seed_prefill("holder", p.prefill.coefficients())
    assert d.ready and d.prefill_source == "holder:holder"
    assert d.prefill_s(2000, 0) == pytest.approx(p.prefill_s(2000, 0))
    choice = decide(d, tokens=2000, matches=[held(62)])
    assert choice.costs.decided_by == "model" and choice.costs.prefill_source == "holder:holder"
    d.seed_prefill("holder", (-1.0, 0.0, 0.0))  # nonsense is ignored
    assert d.prefill_s(2000, 0) == pytest.approx(p.prefill_s(2000, 0))


def test_decisions_say_who_made_them() -> None:
    cold = decide(CostModel(), tokens=100, matches=[held(3)])
    assert (cold.costs.decided_by, cold.costs.fallback_reason) == ("fallback", "no_prefill_timing")
    nothing = decide(CostModel(), tokens=100, matches=[])
    assert (nothing.costs.decided_by, nothing.costs.fallback_reason) == ("fallback", "nothing_to_weigh")
    fixed = decide(trained(**BIG), tokens=100, matches=[held(3)], policy="threshold")
    assert (fixed.costs.decided_by, fixed.costs.fallback_reason) == ("fallback", "threshold_policy")
    warm = decide(trained(**BIG), tokens=100, matches=[held(3)])
    assert (warm.costs.decided_by, warm.costs.fallback_reason) == ("model", "")
    assert warm.costs.attributes()["kvbroker.decided_by"] == "model"


def test_until_observed_the_fixed_threshold_decides() -> None:
    choice = decide(CostModel(), tokens=100, matches=[held(3)])
    assert choice.costs.policy == "threshold_until_observed"
    assert choice.decision.plan is not None and choice.decision.plan.num_tokens == 96
    choice = decide(CostModel(), tokens=50, matches=[held(1)])
    assert choice.decision.plan is None and choice.decision.reason == "below_threshold"


def test_threshold_policy_ignores_the_model() -> None:
    choice = decide(trained(**BIG), tokens=50, matches=[held(1)], policy="threshold")
    assert choice.decision.reason == "below_threshold" and choice.costs.policy == "threshold"


def test_tiny_model_recomputes_short_histories_big_model_pulls_them() -> None:
    tiny, big = trained(**TINY, block_bytes=100_000), trained(**BIG)
    short = decide(tiny, tokens=300, matches=[held(9)])
    assert short.decision.reason == SKIP_COST
    assert short.costs.predicted_recompute_ms < short.costs.predicted_pull_ms
    long = decide(tiny, tokens=4000, matches=[held(124)])
    assert long.decision.plan is not None and long.decision.plan.num_blocks == 124
    one_block = decide(big, tokens=40, matches=[held(1)])
    assert one_block.decision.plan is not None and one_block.decision.plan.num_tokens == 32
    assert one_block.costs.predicted_pull_ms < one_block.costs.predicted_recompute_ms


def test_requests_running_here_make_a_recompute_dearer_than_a_pull() -> None:
    """Alone, the tiny model recomputes a short history; with requests running beside it, the
    seconds it computes are theirs too, while a pull's wait leaves the engine stepping for them."""
    tiny = trained(**TINY, block_bytes=100_000)
    alone = decide(tiny, tokens=300, matches=[held(9)], running=20, neighbour_cost=0.0)
    assert alone.decision.reason == SKIP_COST
    idle = decide(tiny, tokens=300, matches=[held(9)], running=0, neighbour_cost=1.0)
    assert idle.decision.reason == SKIP_COST  # nobody to delay: as before
    crowded = decide(tiny, tokens=300, matches=[held(9)], running=20, neighbour_cost=1.0)
    assert crowded.decision.plan is not None and crowded.decision.plan.num_blocks == 9
    assert "running requests' wait x20" in crowded.decision.detail
    # The predicted times themselves are the request's own, unchanged by the neighbours.
    assert crowded.costs.predicted_recompute_ms == pytest.approx(alone.costs.predicted_recompute_ms)


def test_measured_pulls_move_the_crossover() -> None:
    model = trained(**TINY, block_bytes=100_000)
    assert decide(model, tokens=1500, matches=[held(46)]).decision.plan is not None
    for i in range(5):  # this holder's pulls take 200 ms: not worth it for 1,500 tokens
        model.observe_pull(float(i), "holder", pb.TIER_GPU, 40, 4 * MB, 0.2)
    choice = decide(model, tokens=1500, matches=[held(46)], now=5.0)
    assert choice.decision.reason == SKIP_COST
    assert choice.costs.pull_observations == 5


def test_slow_holder_moves_to_recompute_and_back() -> None:
    model = trained(**BIG)
    now = 0.0

    def observe(seconds: float, n: int) -> None:
        nonlocal now
        for _ in range(n):
            now += 1.0
            model.observe_pull(now, "holder", pb.TIER_GPU, 4, 4 * MB, seconds)

    def pulls() -> bool:
        return decide(model, tokens=140, matches=[held(4)], now=now).decision.plan is not None

    observe(0.02, 5)
    assert pulls()
    observe(2.0, 5)  # the holder turned slow: 2 s for what took 20 ms
    assert not pulls()
    now += 10 * cost_model.PULL_HALF_LIFE_S  # its slow spell is old: try it again
    assert pulls()
    observe(0.02, 3)
    assert pulls()


def test_partial_coverage_and_the_quicker_tier() -> None:
    model = trained(**BIG)
    for i in range(5):
        model.observe_pull(float(i), "gpu-holder", pb.TIER_GPU, 8, 8 * MB, 3.0)  # slow
        model.observe_pull(float(i), "cpu-holder", pb.TIER_CPU, 8, 8 * MB, 0.03)  # quick
    choice = decide(
        model,
        tokens=300,
        matches=[held(9, "gpu-holder"), held(5, "cpu-holder", pb.TIER_CPU)],
        now=5.0,
    )
    plan = choice.decision.plan
    assert plan is not None and plan.holder_engine_id == "cpu-holder" and plan.tier == pb.TIER_CPU
    assert (plan.first_block, plan.num_blocks, plan.num_tokens) == (0, 5, 160), (
        "pull 5 blocks, recompute the rest"
    )


def test_pulls_in_flight_from_a_holder_share_its_bandwidth() -> None:
    model = trained(**BIG, block_bytes=10 * MB)
    for i in range(5):
        model.observe_pull(float(i), "holder", pb.TIER_GPU, 1, 10 * MB, 0.01 + 0.01)  # 1 GB/s
        model.observe_pull(float(i), "holder", pb.TIER_GPU, 10, 100 * MB, 0.01 + 0.1)
    alone = decide(model, tokens=300, matches=[held(9)], now=5.0)
    busy = decide(model, tokens=300, matches=[held(9)], now=5.0, pulls_in_flight={"holder": 3})
    assert alone.decision.plan is not None and busy.decision.plan is not None
    assert busy.costs.predicted_pull_ms == pytest.approx(alone.costs.predicted_pull_ms + 3 * 90, rel=0.05)
    # Other readers' reads of it, as the broker counts them (its count includes this engine's own).
    read = held(9)
    read.reads_in_flight = 3
    shared = decide(model, tokens=300, matches=[read], now=5.0, pulls_in_flight={"holder": 1})
    assert shared.costs.predicted_pull_ms == pytest.approx(busy.costs.predicted_pull_ms)
    assert shared.costs.holder_reads == 3 and shared.costs.attributes()["kvbroker.holder_reads"] == 3
    assert "3 other reads of it in flight" in shared.decision.detail


def test_config_recompute_neighbour_cost() -> None:
    assert AdapterConfig.from_extra_config({}).recompute_neighbour_cost == 1.0
    assert AdapterConfig.from_extra_config({"recompute_neighbour_cost": 0}).recompute_neighbour_cost == 0.0
    for bad in (-1, float("nan")):
        with pytest.raises(AdapterConfigError, match="recompute_neighbour_cost"):
            AdapterConfig.from_extra_config({"recompute_neighbour_cost": bad})


def test_config_pull_policy() -> None:
    assert AdapterConfig.from_extra_config({}).pull_policy == "adaptive"
    override = AdapterConfig.from_extra_config({"kv_recompute_threshold": 32})
    assert override.pull_policy == "threshold" and override.kv_recompute_threshold == 32
    both = AdapterConfig.from_extra_config({"kv_recompute_threshold": 32, "pull_policy": "adaptive"})
    assert both.pull_policy == "adaptive"
    with pytest.raises(AdapterConfigError, match="pull_policy"):
        AdapterConfig.from_extra_config({"pull_policy": "sometimes"})


def test_scheduler_learns_from_its_steps_and_pulls_and_reports_why() -> None:
    sched, link, clock = make(threshold=10_000)  # adaptive: the threshold only rules until observed
    for tokens, context in [(300, 0), (1, 300), (900, 0), (1, 900), (2000, 0), (1, 2000)]:
        sched.build_connector_meta([("warm", tokens, context)])
        was_ready, sched.stats.dirty = sched.costs.ready, False
        clock.advance(step_seconds(tokens, context, **BIG))
        sched.update_connector_output(worker_meta=None, finished_sending=None, finished_recving=None)
        if sched.costs.ready and not was_ready:
            assert sched.stats.dirty, "the stats file hears that the model is ready"
    assert sched.costs.ready
    req = FakeRequest("r1", num_tokens=140)
    pull_to_reading(sched, link, req, holder_info())  # asserts it pulls 128 tokens
    assert sched.stats.counters["decided_pull_adaptive"] == 1
    assert sched.stats.counters["decisions_by_model"] == 1
    figures = sched.stats_snapshot()["figures"]
    assert figures["last_pull_policy"] == "adaptive"
    assert figures["last_predicted_recompute_ms"] > figures["last_predicted_pull_ms"] > 0
    clock.advance(0.05)
    sched.update_connector_output(
        worker_meta=ReadOutcomes(done={"r1": 1}, bytes_read={"r1": 4 * MB}),
        finished_sending=None,
        finished_recving=None,
    )
    link.named("release")[0].future.set_result(pb.Lease(lease_id="hold-1", state=pb.LEASE_RELEASED))  # type: ignore[union-attr]
    sched.build_connector_meta([])
    sched.update_connector_output(worker_meta=None, finished_sending=None, finished_recving={"r1"})
    holders = sched.stats_snapshot()["cost_model"]["holders"]
    assert holders["holder/TIER_GPU"]["observations"] == 1
    assert sched.costs.block_bytes == MB


def test_a_request_may_name_its_rule() -> None:
    from kvbroker.engine_adapter.decisions import BadTransferParams, parse_transfer_params

    sched, link, _ = make()  # adaptive, threshold 64
    fixed = FakeRequest("r1", num_tokens=60, kv_transfer_params={"kvbroker": {"kv_recompute_threshold": 0}})
    sched.get_num_new_matched_tokens(fixed, 0)
    resolved(link, match(1))
    assert sched.get_num_new_matched_tokens(fixed, 0) == (32, True), "threshold 0 for this request: pull"
    assert parse_transfer_params({"kvbroker": {"pull_policy": "adaptive"}}).pull_policy == "adaptive"
    assert parse_transfer_params({"kvbroker": {"kv_recompute_threshold": 5}}).pull_policy == "threshold"
    for bad in ({"pull_policy": "never"}, {"kv_recompute_threshold": -1}, {"kv_recompute_threshold": "5"}):
        with pytest.raises(BadTransferParams, match="kvbroker"):
            parse_transfer_params({"kvbroker": bad})


def test_weighing_only_the_stretch_ends_finds_the_quickest_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy weighs a few block ends per prompt; every end weighed picks the same plan."""
    import random

    from kvbroker.engine_adapter import pull_policy

    rng = random.Random(7)
    for case in range(300):
        a, b, c = rng.uniform(0.001, 0.05), rng.uniform(1e-6, 3e-3), rng.choice([0.0, rng.uniform(0, 3e-7)])
        model = trained(a, b, c, block_bytes=rng.choice([MB // 8, MB, 8 * MB]))
        model.chunk_tokens = rng.choice([0, 64, 256, 2048])
        for i in range(4):
            holder = rng.choice(["h1", "h2"])
            blocks = rng.randint(1, 40)
            model.observe_pull(float(i), holder, pb.TIER_GPU, blocks, blocks * MB, rng.uniform(0.002, 0.3))
        tokens = rng.randint(BS + 1, 4000)
        local = rng.choice([0, BS * rng.randint(0, max(0, tokens // BS - 1))])
        matches = [held(rng.randint(1, tokens // BS + 1), "h1"), held(rng.randint(1, tokens // BS + 1), "h2")]
        matches[1].load = rng.choice([0.0, 3.0])
        kw = {"tokens": tokens, "matches": matches, "now": 5.0, "local": local}
        fast = decide(model, **kw)
        with monkeypatch.context() as m:
            m.setattr(pull_policy, "candidate_ends", lambda lo, hi, *_: list(range(lo, hi + 1)))
            every = decide(model, **kw)
        assert fast.decision == every.decision, case
        assert fast.costs.predicted_pull_ms == pytest.approx(every.costs.predicted_pull_ms), case


def test_a_long_prompt_is_decided_in_a_few_predictions() -> None:
    from kvbroker.engine_adapter.pull_policy import candidate_ends

    ends = candidate_ends(1, 4096, 131072, BS, 2048)
    assert len(ends) <= 2 * (131072 // 2048) + 2
    assert ends == sorted(ends) and ends[0] == 1 and ends[-1] == 4096
    assert candidate_ends(1, 128, 4096, BS, 0) == [1, 128]
    assert candidate_ends(5, 4, 4096, BS, 0) == []


def test_chunked_prefill_prediction_is_the_sum_of_its_steps() -> None:
    model = PrefillModel()
    for i, (tokens, context) in enumerate([(300, 0), (900, 0), (64, 2000), (2000, 0), (1, 64)]):
        model.observe(float(i), step_seconds(tokens, context, 0.01, 1e-4, 2e-8), [(tokens, context)])
    a, b, c = model.coefficients()
    steps = sum(
        a + b * n / 1e3 + c * n * (ctx + n / 2) / 1e6
        for ctx, n in [(100, 256), (356, 256), (612, 256), (868, 100)]
    )
    assert model.predict(868, 100, chunk_tokens=256) == pytest.approx(steps)
    assert model.predict(0, 100, chunk_tokens=256) == 0.0


def test_a_decode_engine_decides_by_the_model_with_its_holders_timings() -> None:
    """P's kv_transfer_params carry its prefill fit; D, which never prefills, decides with it."""
    from kvbroker.engine_adapter.decisions import BadTransferParams, parse_transfer_params

    sched, link, _ = make(threshold=10_000)  # adaptive; the fixed rule would never pull
    params = {
        "do_remote_prefill": True,
        "kvbroker": {
            "holder_engine_id": "holder",
            "prefill_model": {"step_ms": 30.0, "ms_per_1k_tokens": 2200.0, "ms_per_1m_pairs": 0.1},
        },
    }
    req = FakeRequest("r1", num_tokens=140, kv_transfer_params=params)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    resolved(link, match(4))
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)
    assert sched.stats.counters["decisions_by_model"] == 1
    assert sched.stats.counters["fallback_no_prefill_timing"] == 0
    assert sched.stats_snapshot()["cost_model"]["prefill_source"] == "holder:holder"
    with pytest.raises(BadTransferParams, match="prefill_model"):
        parse_transfer_params({"kvbroker": {"prefill_model": {"step_ms": -1}}})


def test_a_cold_decode_engine_counts_its_fallbacks() -> None:
    sched, link, _ = make(threshold=64)
    req = FakeRequest("r1", num_tokens=140)
    sched.get_num_new_matched_tokens(req, 0)
    resolved(link, match(4))
    assert sched.get_num_new_matched_tokens(req, 0) == (128, True)
    assert sched.stats.counters["decisions_by_fallback"] == 1
    assert sched.stats.counters["fallback_no_prefill_timing"] == 1
