"""bench.fleet.fleet's agent sessions (bench/fleet/agent_sessions.py) and figures, without engines: seeded, skewed, bursty, growing."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter

import pytest

from bench.fleet.agent_sessions import TOKEN_BASE, WorkloadSpec, burst_arrivals, generate
from bench.fleet.driver import RunRecord, Turn
from bench.fleet.report import pct, summarize, table

SPEC = WorkloadSpec(sessions=400, classes=4, class_skew=1.2, think_s=1.0, seed=7)


def test_same_seed_same_plan_other_seed_other_plan() -> None:
    assert generate(SPEC) == generate(SPEC)
    other = generate(WorkloadSpec(sessions=400, seed=8))
    assert other.sessions != generate(SPEC).sessions


def test_class_draw_is_skewed_towards_the_first_class() -> None:
    counts = Counter(s.agent_class for s in generate(SPEC).sessions)
    assert counts[0] > counts[1] > counts[3] > 0
    assert counts[0] > 2 * counts[3]


def test_hot_sessions_have_more_turns_and_shorter_thinks() -> None:
    plan = generate(SPEC)
    hot = [s for s in plan.sessions if s.hot]
    cold = [s for s in plan.sessions if not s.hot]
    assert 0.15 < len(hot) / len(plan.sessions) < 0.35
    assert {s.turns for s in hot} == {SPEC.hot_turns} and {s.turns for s in cold} == {SPEC.cold_turns}
    hot_think = statistics.mean(t for s in hot for t in s.think_s)
    cold_think = statistics.mean(t for s in cold for t in s.think_s)
    assert hot_think < cold_think / 2


def test_arrivals_come_in_bursts() -> None:
    import random

    spec = WorkloadSpec(sessions=600, burst_mean=4.0, burst_spread_s=0.05)
    times = burst_arrivals(spec, random.Random(1), session_rate=1.0)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times == sorted(times) and len(times) == 600
    # Within a burst sessions come 0.05 s apart at most; between bursts about 4 s (rate 1/4).
    short = sum(1 for g in gaps if g <= 0.05)
    assert 0.6 < short / len(gaps) < 0.85
    assert times[-1] / len(times) == pytest.approx(1.0, rel=0.25)  # one session a second on average


def test_at_rate_rescales_arrivals_and_keeps_sessions() -> None:
    plan = generate(SPEC)
    fast = plan.at_rate(4.0)
    assert [s.user_messages for s in fast.sessions] == [s.user_messages for s in plan.sessions]
    assert fast.sessions[-1].start_s == pytest.approx(plan.sessions[-1].start_s / 4)
    # Offered load: requests over the arrival span, about the rate asked for.
    assert plan.requests / plan.sessions[-1].start_s == pytest.approx(1.0, rel=0.25)
    with pytest.raises(ValueError):
        plan.at_rate(0)


def test_history_grows_with_user_messages_and_answers() -> None:
    plan = generate(WorkloadSpec(sessions=20, hot_fraction=1.0, hot_turns=3))
    session = plan.sessions[0]
    answers = [[1, 2, 3] * 8, [4, 5, 6] * 8]
    p0, p1, p2 = (plan.prompt(session, k, answers[:k]) for k in range(3))
    system = list(plan.system_prompts[session.agent_class])
    assert p0 == system + list(session.user_messages[0])
    assert p1[: len(p0)] == p0 and p1[len(p0) : len(p0) + 24] == answers[0]
    assert p2[: len(p1)] == p1 and len(p2) == plan.prompt_tokens(session, 2)
    assert all(TOKEN_BASE <= t < TOKEN_BASE + plan.spec.vocab_span for t in p0)
    with pytest.raises(ValueError):
        plan.prompt(session, 2, answers[:1])


def test_ideal_reuse_counts_history_and_shared_system_prompts() -> None:
    spec = WorkloadSpec(sessions=30, system_tokens=100, user_tokens=20, answer_tokens=12, block_size=32)
    plan = generate(spec)
    ideal = plan.ideal_cached_tokens()
    first_of_class: dict[int, str] = {}
    for s in sorted(plan.sessions, key=lambda x: (x.start_s, x.sid)):
        first_of_class.setdefault(s.agent_class, s.sid)
        want0 = 0 if first_of_class[s.agent_class] == s.sid else 96  # 3 whole blocks of the 100
        assert ideal[(s.sid, 0)] == want0
        # Turn 2: turn 1's prompt (120) and answer (12) but its last token: 131 -> 4 blocks.
        assert ideal[(s.sid, 1)] == 128
    assert 0 < plan.ideal_reuse() < 1


def test_summary_goodput_reuse_and_failures() -> None:
    plan = generate(WorkloadSpec(sessions=2, hot_fraction=0.0, cold_turns=2))
    s0, s1 = plan.sessions
    turns = [
        Turn(s0.sid, 0, 0.0, 560, ttft_s=0.1, e2e_s=0.5, output_tokens=24),  # good
        Turn(s0.sid, 1, 1.0, 632, ttft_s=0.9, e2e_s=1.2, output_tokens=24),  # TTFT too slow
        Turn(s1.sid, 0, 0.5, 560, error="RuntimeError: HTTP 500"),
    ]
    record = RunRecord(turns, not_sent=1, wall_s=2.0, outputs={})
    out = summarize(
        record,
        plan,
        slo_ttft_s=0.5,
        slo_tpot_s=0.05,
        sources=({"local_compute": 100}, {"local_compute": 100 + 876, "external_kv_transfer": 64}),
        connector=({"loads_ready": 2, "load_ready_steps": 9}, {"loads_ready": 6, "load_ready_steps": 17}),
        kv_bytes_per_token=1024,
    )
    assert out["load_ready_steps_mean"] == 2.0, "(17 - 9) steps over (6 - 2) loads"
    assert out["goodput_rps"] == 0.5 and out["throughput_rps"] == 1.0
    assert out["failed"] == 1 and out["not_sent"] == 1
    assert out["prompt_tokens"] == 1752 and out["recomputed_tokens"] == 876
    assert out["prefix_reuse"] == 0.5
    assert out["pulled_tokens"] == 64 and out["pulled_bytes"] == 65536 and out["pulled_bytes_estimated"]
    assert (out["missed_ttft_only"], out["missed_tpot_only"], out["missed_both"]) == (1, 0, 0)
    # The ceiling: the plan's 4 requests over its shortest wall with turns of 0.5 s (the quickest).
    assert out["goodput_ceiling_rps"] == round(4 / plan.min_wall_s(0.5), 3)
    assert [row[:2] for row in out["turns"]] == [[s0.sid, 0], [s0.sid, 1]]
    # Where a wait went shows end to end: 0.5 and 1.2 s; time per token (0.4/23, 0.3/23 s) p90.
    assert out["e2e_ms"] == {"p50": 500.0, "p90": 1200.0}
    assert out["tpot_ms_p90"] == round(0.4 / 23 * 1000, 2)
    line = table({"x": {"runs": [{**out, "per_engine": None, "leases_left": 0}]}}).splitlines()[2]
    assert " / 1.2 " in line and f"/ {0.4 / 23 * 1000:.0f}" in line


def test_min_wall_follows_the_latest_session_s_chain_of_turns() -> None:
    plan = generate(WorkloadSpec(sessions=3, hot_fraction=0.0, cold_turns=2, seed=3))
    want = max(s.start_s + 2 * 1.5 + sum(s.think_s) for s in plan.sessions)
    assert plan.min_wall_s(1.5) == pytest.approx(want)
    assert plan.min_wall_s(0.0) < plan.min_wall_s(1.5)
    faster = plan.at_rate(10.0)  # arrivals closer together; think time is the users'
    assert faster.min_wall_s(1.5) < plan.min_wall_s(1.5)


def test_pct_is_nearest_rank() -> None:
    assert pct([], 0.5) != pct([], 0.5)  # NaN
    assert pct([3.0, 1.0, 2.0], 0.5) == 2.0
    assert pct(list(range(1, 101)), 0.9) == 90 and pct(list(range(1, 101)), 0.99) == 99


def test_our_proxy_s_counts_are_read_from_its_metrics_page() -> None:
    from bench.fleet.report import proxy_counts

    page = "\n".join(
        [
            "# HELP kvbroker_proxy_route_choices_total routing choices",
            'kvbroker_proxy_route_choices_total{reason="dp_holder"} 296.0',
            'kvbroker_proxy_route_choices_total{reason="dp_pull_busy_holder"} 5.2e+01',
            'kvbroker_proxy_admission_wait_seconds_count{order="overdue"} 124.0',
            'kvbroker_proxy_admission_wait_seconds_sum{order="overdue"} 9000.5',
            'kvbroker_proxy_admission_wait_seconds_bucket{le="1.0",order="overdue"} 0.0',
            'kvbroker_proxy_early_first_tokens_total{result="sent"} 176.0',
        ]
    )
    assert proxy_counts(page) == {
        "route_reasons": {"dp_holder": 296, "dp_pull_busy_holder": 52},
        "admission_orders": {"overdue": 124},
        "early_first_tokens": {"sent": 176},
    }
    assert proxy_counts('kvbroker_proxy_route_choices_total{reason="dp_holder"} 3.0') == {
        "route_reasons": {"dp_holder": 3}
    }


def test_router_counts_are_per_run() -> None:
    from bench.fleet.fleet import router_delta

    before = {"policy": "prefix", "routed": {"a": 3, "b": 1}, "scored_hits": 2, "score_errors": 0}
    after = {"policy": "prefix", "routed": {"a": 5, "b": 4, "c": 1}, "scored_hits": 6, "score_errors": 1}
    assert router_delta(before, after) == {
        "policy": "prefix",
        "routed": {"a": 2, "b": 3, "c": 1},
        "scored_hits": 4,
        "score_errors": 1,
    }
    assert router_delta({}, {}) == {}
    # Our proxy's routing choices by reason (its /metrics counters) are per run too.
    ours = router_delta(
        {"route_reasons": {"dp_holder": 4}}, {"route_reasons": {"dp_holder": 9, "dp_pull": 2}}
    )
    assert ours == {"route_reasons": {"dp_holder": 5, "dp_pull": 2}}
    # So are its admission orders and early first tokens.
    ours = router_delta(
        {"admission_orders": {"in_time": 2}, "early_first_tokens": {"sent": 1}},
        {"admission_orders": {"in_time": 5, "rest_in_time": 1}, "early_first_tokens": {"sent": 4}},
    )
    assert ours == {"admission_orders": {"in_time": 3, "rest_in_time": 1}, "early_first_tokens": {"sent": 3}}
    # A router that died mid-run leaves its counts out, not the run.
    assert router_delta({"routed": {"a": 1}}, {"error": "gone"}) == {"error": "gone"}


class _FakeScores:
    """Score answers by engine id (what the broker would say), and the layout every engine has."""

    def __init__(self, held: dict[str, int]) -> None:
        self.held = held

    async def list_engines(self) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(engines=[SimpleNamespace(engine_id=e, layout_id="L") for e in self.held])

    async def score(self, **_: object) -> object:
        from types import SimpleNamespace

        scores = [SimpleNamespace(engine_id=e, gpu_blocks=n, cpu_blocks=0) for e, n in self.held.items()]
        return SimpleNamespace(scores=scores)


def test_prefix_router_sends_to_the_holder_and_breaks_ties_by_load() -> None:
    import asyncio

    from bench.fleet.router import Picker

    picker = Picker({"a": "http://a", "b": "http://b"}, "prefix", "broker:1")
    picker.client = _FakeScores({"a": 0, "b": 3})
    body = {"prompt": [11, 12, 13], "cache_salt": "s"}
    picker.in_flight["b"] = 5  # the holder is busy: the prefix policy still sends it there
    assert asyncio.run(picker.pick(body)) == "b" and picker.scored_hits == 1
    picker.client = _FakeScores({"a": 0, "b": 0})  # nobody holds it: the less busy engine
    assert asyncio.run(picker.pick(body)) == "a"
    rr = Picker({"a": "http://a", "b": "http://b"}, "rr")
    assert [asyncio.run(rr.pick(body)) for _ in range(4)] == ["a", "b", "a", "b"]
