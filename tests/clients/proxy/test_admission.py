"""The proxy's admission (clients/proxy/admission.py): who waits, who goes next, and that a
client leaving while it waits, or just as it is let in, never loses or leaks a place."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest

from kvbroker.clients.proxy.admission import (
    AT_ONCE,
    FIRST_COME,
    IN_TIME,
    LATE,
    OVERDUE,
    REST_IN_TIME,
    Admission,
    Ticket,
)
from kvbroker.clients.proxy.config import build_parser, config_from_args
from kvbroker.clients.proxy.outcome import Outcome
from tests.clients.proxy.admission_util import Clock, answers, settle
from tests.clients.proxy.test_proxy import COMPLETION, engines, proxy

pytestmark = pytest.mark.timeout(30)
__all__ = ["engines", "proxy"]  # the fixtures, shared with test_proxy.py


async def test_off_lets_everyone_in_at_once() -> None:
    adm = Admission(0)
    got = [await adm.enter() for _ in range(50)]
    assert {a.order for a in got} == {AT_ONCE} and adm.running == 50 and adm.waiting == 0


async def test_the_limit_is_per_engine_and_a_leave_lets_the_next_in() -> None:
    adm = Admission(2)
    adm.set_engines(2)
    first = [await adm.enter() for _ in range(4)]
    assert all(a.order == AT_ONCE for a in first)
    fifth = asyncio.ensure_future(adm.enter())
    await settle()
    assert not fifth.done() and adm.waiting == 1
    adm.leave()
    await settle()
    assert fifth.done() and fifth.result().order == FIRST_COME and adm.running == 4


async def test_more_engines_let_waiting_requests_in() -> None:
    adm = Admission(1)
    adm.set_engines(1)
    await adm.enter()
    waiting = [asyncio.ensure_future(adm.enter()) for _ in range(2)]
    await settle()
    assert adm.waiting == 2
    adm.set_engines(3)
    await settle()
    assert all(w.done() for w in waiting) and adm.running == 3


async def test_one_that_can_still_meet_the_goal_goes_before_one_past_it() -> None:
    clock = Clock()
    adm = Admission(1, ttft_goal_s=2.0, clock=clock)
    adm.observed_ttft(0.5)
    await adm.enter()
    old = asyncio.ensure_future(adm.enter())
    await settle()
    clock.now += 1.8  # old has waited 1.8 s: with 0.5 s to its first token it is late
    new = asyncio.ensure_future(adm.enter())
    await settle()
    adm.leave()
    await settle()
    assert new.done() and not old.done()
    assert new.result().order == IN_TIME
    adm.leave()
    await settle()
    assert old.done() and old.result().order == LATE  # every one left is late: the oldest


async def test_among_those_in_time_the_oldest_goes() -> None:
    clock = Clock()
    adm = Admission(1, ttft_goal_s=10.0, clock=clock)
    await adm.enter()
    waiters = []
    for _ in range(3):
        waiters.append(asyncio.ensure_future(adm.enter()))
        await settle()
        clock.now += 1.0
    adm.leave()
    await settle()
    assert [w.done() for w in waiters] == [True, False, False]


async def test_a_request_whose_first_token_went_out_goes_while_its_rest_can_keep_the_pace() -> None:
    clock = Clock()
    # Goal: first token within 4 s, then 0.3 s a token; measured: 1 s to a first token, 0.2 s a token.
    adm = Admission(1, ttft_goal_s=4.0, tpot_goal_s=0.3, clock=clock)
    adm.observed_ttft(1.0)
    answers(adm, 0.2, 1)
    await adm.enter()
    early = Ticket()
    old = asyncio.ensure_future(adm.enter(early))
    await settle()
    clock.now += 4.0  # past its first-token deadline (3 s): its first token goes out early now
    adm.first_token_out(early, 10)  # 10 tokens left at 0.2 s against 0.3 s: 1 s of slack
    new = [asyncio.ensure_future(adm.enter()) for _ in range(2)]  # in time, deadline in 3 s
    await settle()
    adm.leave()
    await settle()
    assert old.done() and old.result().order == REST_IN_TIME and not any(w.done() for w in new)
    # Once the rest cannot keep the pace any more it is late again: the new ones go first.
    late, later = Ticket(), Ticket()
    stale = asyncio.ensure_future(adm.enter(late))
    nearly = asyncio.ensure_future(adm.enter(later))
    await settle()
    adm.first_token_out(late, 10)  # dispatch by now + 1 s ...
    clock.now += 1.5  # ... missed
    adm.first_token_out(later, 40)  # dispatch by now + 4 s: after new[0]'s deadline (now + 1.5 s)
    adm.leave()
    await settle()
    assert new[0].done() and new[0].result().order == IN_TIME and not stale.done() and not nearly.done()
    adm.leave()  # new[1]'s deadline is now + 1.5 s too, earlier than nearly's
    await settle()
    assert new[1].done() and not nearly.done()
    adm.leave()
    await settle()
    assert nearly.done() and nearly.result().order == REST_IN_TIME and not stale.done()
    adm.leave()
    await settle()
    assert stale.done() and stale.result().order == LATE


async def test_no_rest_deadline_without_slack_a_pace_goal_or_a_wait() -> None:
    clock = Clock()
    adm = Admission(1, ttft_goal_s=4.0, tpot_goal_s=0.3, clock=clock)
    await adm.enter()
    unmeasured, slower, gone = Ticket(), Ticket(), Ticket()
    waits = [asyncio.ensure_future(adm.enter(t)) for t in (unmeasured, slower, gone)]
    await settle()
    adm.first_token_out(unmeasured, 10)  # no pace measured yet: no slack is assumed
    answers(adm, 0.5, 1)
    adm.first_token_out(slower, 10)  # the engines run slower than the goal: the rest will be late
    waits[2].cancel()
    await settle()
    adm.first_token_out(gone, 10)  # its client left: nothing to mark
    adm.first_token_out(Ticket(), 10)  # never waited
    assert adm._rest == [] and adm.waiting == 2
    for t in waits[:2]:
        adm.leave()
        await settle()
        assert t.done() and t.result().order == LATE


async def test_nothing_waits_past_max_wait() -> None:
    clock = Clock()
    adm = Admission(1, ttft_goal_s=2.0, max_wait_s=30.0, clock=clock)
    await adm.enter()
    old = asyncio.ensure_future(adm.enter())
    await settle()
    clock.now += 31.0
    new = asyncio.ensure_future(adm.enter())  # in time, but old has waited 31 s
    await settle()
    adm.leave()
    await settle()
    assert old.done() and old.result().order == OVERDUE and not new.done()
    assert old.result().waited_s == pytest.approx(31.0)


async def test_overdue_requests_get_every_other_place_not_all() -> None:
    clock = Clock()
    adm = Admission(1, ttft_goal_s=2.0, max_wait_s=30.0, clock=clock)
    adm.observed_ttft(0.5)
    await adm.enter()
    old = [asyncio.ensure_future(adm.enter()) for _ in range(3)]
    await settle()
    clock.now += 31.0  # a backlog longer than max_wait_s: all three are overdue
    new = [asyncio.ensure_future(adm.enter()) for _ in range(2)]
    await settle()
    let_in = []
    for _ in range(5):
        adm.leave()
        await settle()
        let_in += [w for w in old + new if w.done() and w not in let_in]
    orders = [w.result().order for w in let_in]
    assert let_in == [old[0], new[0], old[1], new[1], old[2]]
    assert orders == [OVERDUE, IN_TIME, OVERDUE, IN_TIME, OVERDUE]


async def test_a_client_that_leaves_while_waiting_takes_no_place() -> None:
    adm = Admission(1)
    await adm.enter()
    gone = asyncio.ensure_future(adm.enter())
    stays = asyncio.ensure_future(adm.enter())
    await settle()
    gone.cancel()
    await settle()
    assert adm.waiting == 1
    adm.leave()
    await settle()
    assert stays.done() and adm.running == 1 and adm.waiting == 0


async def test_a_client_cancelled_just_as_it_is_let_in_gives_its_place_back() -> None:
    adm = Admission(1)
    await adm.enter()
    late = asyncio.ensure_future(adm.enter())
    nxt = asyncio.ensure_future(adm.enter())
    await settle()
    adm.leave()  # `late` is given the place (its future resolved) ...
    late.cancel()  # ... and cancelled before it resumes
    await settle()
    assert late.cancelled()
    assert nxt.done() and adm.running == 1 and adm.waiting == 0


async def test_a_slow_pace_takes_places_away_down_to_one_per_engine() -> None:
    adm = Admission(4, tpot_goal_s=0.1)
    adm.set_engines(2)
    assert adm.limit == 8
    answers(adm, 0.3, 12)  # a change every two answers (one per engine)
    assert adm.limit == 2
    answers(adm, 0.3, 4)
    assert adm.limit == 2  # one per engine: never fewer
    adm.observed_tpot(0.01)  # nobody waits: no reason to add a place
    assert adm.limit == 2


async def test_where_fewer_at_once_is_no_faster_places_come_back_then_fewer_is_tried_again() -> None:
    adm = Admission(4, tpot_goal_s=0.1)
    adm.set_engines(2)
    answers(adm, 0.3, 12)  # each limit from 8 down to 3 measured at 0.3 s a token
    assert adm.limit == 2
    for _ in range(2):
        await adm.enter()
    waiting = [asyncio.ensure_future(adm.enter()) for _ in range(10)]
    await settle()
    answers(adm, 0.3, 2)  # one per engine: as slow, and there is nothing lower to try
    assert adm.limit == 3
    answers(adm, 0.3, 10)  # each limit measured again: none lower is faster
    assert adm.limit == 8  # holding requests back buys no pace: every place serves
    await settle()
    assert sum(w.done() for w in waiting) == 6
    answers(adm, 0.3, 100 * 2 - 12)
    assert adm.limit == 8
    answers(adm, 0.3, 20)  # ... until what was measured below is old: fewer is tried again
    assert adm.limit < 8


async def test_a_slow_pace_goes_back_to_the_limit_where_it_was_faster() -> None:
    adm = Admission(4, tpot_goal_s=0.1)
    adm.set_engines(1)
    for _ in range(4):
        await adm.enter()
    waiting = [asyncio.ensure_future(adm.enter()) for _ in range(10)]
    await settle()
    steps = [
        (0.2, 3),  # at 4, over the goal; 3 not measured: try it
        (0.12, 2),  # faster, still over; 2 not measured: try it
        (0.115, 1),  # and 1
        (0.115, 2),  # one per engine is over the goal too: nothing lower to try, requests wait
        (0.115, 3),  # 1 was measured no faster than 2: fewer does not help
        (0.12, 4),  # nor is any lower limit 15% faster than 3
        (0.2, 3),  # 4 is slow again, and 3 was measured 15% faster: back to it
    ]
    for pace, limit in steps:
        adm.observed_tpot(pace)
        assert adm.limit == limit, (pace, limit)
    assert not all(w.done() for w in waiting)


async def test_after_a_long_stay_at_one_limit_the_latest_answers_can_add_a_place() -> None:
    adm = Admission(4, tpot_goal_s=0.1)
    adm.set_engines(1)
    answers(adm, 0.3, 2)
    assert adm.limit == 2
    for _ in range(2):
        await adm.enter()
    waiting = asyncio.ensure_future(adm.enter())
    await settle()
    answers(adm, 0.095, 20)  # under the goal, not under 0.8 of it: the limit holds
    assert adm.limit == 2
    answers(adm, 0.05, 3)  # the mean at 2 is still 0.089; the latest answers are quick
    assert adm.limit == 3
    await settle()
    assert waiting.done()


async def test_a_goal_met_at_one_per_engine_keeps_the_limit_there() -> None:
    adm = Admission(4, tpot_goal_s=0.1)
    adm.set_engines(2)
    answers(adm, 0.3, 12)
    answers(adm, 0.09, 20)  # at one per engine each answer meets the goal: the mean is under it
    assert adm.limit == 2  # (more places only while requests wait)


async def test_a_quick_pace_gives_places_back_when_requests_wait() -> None:
    adm = Admission(3, tpot_goal_s=0.1)
    adm.set_engines(1)
    answers(adm, 0.5, 2)
    assert adm.limit == 1
    await adm.enter()
    waiting = [asyncio.ensure_future(adm.enter()) for _ in range(3)]
    await settle()
    for _ in range(20):
        adm.observed_tpot(0.05)
        await settle()
    assert adm.limit == 3  # per_engine: never more
    assert sum(w.done() for w in waiting) == 2 and adm.running == 3


async def test_each_change_waits_for_as_many_answers_as_engines() -> None:
    adm = Admission(4, tpot_goal_s=0.1)
    adm.set_engines(4)
    answers(adm, 1.0, 3)
    assert adm.limit == 16
    adm.observed_tpot(1.0)
    assert adm.limit == 15


async def test_more_engines_keep_the_places_each_engine_has() -> None:
    adm = Admission(4, tpot_goal_s=0.1)
    adm.set_engines(2)
    answers(adm, 1.0, 8)
    assert adm.limit == 4  # 2 per engine
    adm.set_engines(4)
    assert adm.limit == 8


async def test_answers_before_the_engines_changed_do_not_count_toward_the_new_limit_s_pace() -> None:
    adm = Admission(4, tpot_goal_s=0.1)
    adm.set_engines(2)
    answers(adm, 0.3, 8)
    assert adm.limit == 4  # 2 per engine
    adm.observed_tpot(0.3)  # one answer at 4: too few to judge that limit
    adm.set_engines(1)  # an engine went: 2 places, in all
    assert adm.limit == 2
    for _ in range(2):
        await adm.enter()
    waiting = asyncio.ensure_future(adm.enter())
    await settle()
    adm.observed_tpot(0.07)  # quick at the new limit: counted with the 0.3 before, it would be slow
    assert adm.limit == 3
    await settle()
    assert waiting.done()


def test_a_streamed_answer_s_pace_is_measured_per_event() -> None:
    outcome = Outcome("r")
    assert outcome.tpot_s() is None
    outcome.first_byte()
    outcome.streamed(b'data: {"a": 1}\n\n')
    outcome.streamed(b'data: {"a": 2}\n\ndata: {"a": 3}\n\n')
    outcome.streamed(b"data: [DONE]\n\n")
    assert outcome.stream_events == 3
    pace = outcome.tpot_s()
    assert pace is not None and pace >= 0


@pytest.mark.parametrize(
    ("per_engine", "goal", "max_wait", "tpot"),
    [(-1, 0.0, 1.0, 0.0), (1, -1.0, 1.0, 0.0), (1, 0.0, 0.0, 0.0), (1, 0.0, 1.0, -0.1)],
)
def test_bad_settings_are_refused(per_engine: int, goal: float, max_wait: float, tpot: float) -> None:
    with pytest.raises(ValueError):
        Admission(per_engine, goal, max_wait, tpot)


# The proxy with admission on, against a fake engine that answers after 0.4 s.


async def test_the_proxy_runs_one_request_per_engine_and_holds_the_rest(engines: Any, proxy: Any) -> None:
    d = await engines("D", mode="slow", delay_s=0.4)
    px = await proxy([], [d.url], admit_per_engine=1, admit_ttft_goal_ms=60_000)
    started = time.perf_counter()
    answers = await asyncio.gather(*(px.post("/v1/completions", COMPLETION) for _ in range(3)))
    took = time.perf_counter() - started
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert took >= 3 * 0.4 - 0.05  # one at a time: without admission the three overlap (~0.4 s)
    async with px.http.get(px.url + "/metrics") as resp:
        body = await resp.text()
    assert 'kvbroker_proxy_admission_wait_seconds_count{order="at_once"} 1.0' in body
    assert 'kvbroker_proxy_admission_wait_seconds_count{order="in_time"} 2.0' in body
    assert "kvbroker_proxy_requests_waiting 0.0" in body and "kvbroker_proxy_requests_running 0.0" in body


async def test_without_admission_requests_overlap(engines: Any, proxy: Any) -> None:
    d = await engines("D", mode="slow", delay_s=0.4)
    px = await proxy([], [d.url])
    started = time.perf_counter()
    answers = await asyncio.gather(*(px.post("/v1/completions", COMPLETION) for _ in range(3)))
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert time.perf_counter() - started < 3 * 0.4  # the counterpart of the test above
    async with px.http.get(px.url + "/metrics") as resp:
        assert "kvbroker_proxy_admission_wait_seconds_count" not in await resp.text()


@pytest.mark.parametrize(
    "flags",
    [
        ["--admit-per-engine", "-1"],
        ["--admit-ttft-goal-ms", "-5"],
        ["--admit-tpot-goal-ms", "-5"],
        ["--admit-max-wait-s", "0"],
    ],
)
def test_bad_admission_flags_are_refused(flags: list[str]) -> None:
    args = build_parser().parse_args(["--engine", "http://127.0.0.1:9", *flags])
    with pytest.raises(SystemExit, match="admit"):
        config_from_args(args)


async def test_the_proxy_measures_streamed_answers_and_runs_fewer_when_they_are_slow(
    engines: Any, proxy: Any
) -> None:
    d = await engines("D", mode="trickle", delay_s=0.02, words=6)
    px = await proxy([], [d.url], admit_per_engine=3, admit_tpot_goal_ms=1.0)
    stream = {**COMPLETION, "stream": True}
    for _ in range(4):
        status, _, _ = await px.post("/v1/completions", stream)
        assert status == 200
    async with px.http.get(px.url + "/metrics") as resp:
        body = await resp.text()
    pace = float(re.search(r"^kvbroker_proxy_admission_pace_seconds (\S+)$", body, re.MULTILINE).group(1))
    assert 0.01 < pace < 1.0  # about one word per 20 ms
    assert "kvbroker_proxy_admission_limit 1.0" in body  # 3 -> 1: slower than the 1 ms goal


async def test_an_engine_that_freezes_gives_back_the_places_of_its_requests(engines: Any, proxy: Any) -> None:
    """A failure that sends no reset (a SIGSTOPped engine: nothing answers, /health included)
    while requests wait at the proxy: the liveness check abandons the frozen engine, its
    requests go to the other one, and every place comes back (none kept by the frozen one)."""
    frozen, live = await engines("D1", mode="frozen"), await engines("D2", mode="slow", delay_s=0.2)
    fast = {"first_byte_timeout_s": 0.3, "probe_timeout_s": 0.3}
    px = await proxy([], [frozen.url, live.url], admit_per_engine=1, admit_ttft_goal_ms=60_000, **fast)
    answers = await asyncio.gather(*(px.post("/v1/completions", COMPLETION) for _ in range(4)))
    assert [status for status, _, _ in answers] == [200] * 4
    assert all(headers["X-KVBroker-Decode"] == live.url for _, headers, _ in answers)
    assert len(frozen.completions()) >= 1  # one was sent to it, and abandoned
    async with px.http.get(px.url + "/metrics") as resp:
        body = await resp.text()
    assert "kvbroker_proxy_requests_running 0.0" in body and "kvbroker_proxy_requests_waiting 0.0" in body
    assert 'kind="hung"' in body


async def test_a_stream_that_freezes_midway_gives_its_place_back(engines: Any, proxy: Any) -> None:
    d = await engines("D", mode="freeze_mid_stream")
    px = await proxy([], [d.url], admit_per_engine=1, first_byte_timeout_s=0.3, probe_timeout_s=0.3)
    answers = await asyncio.gather(
        *(px.post("/v1/completions", {**COMPLETION, "stream": True}) for _ in range(2))
    )
    for status, _, raw in answers:
        assert status == 200 and b"failed mid-stream" in raw  # each ends with an error event
    async with px.http.get(px.url + "/metrics") as resp:
        body = await resp.text()
    assert "kvbroker_proxy_requests_running 0.0" in body and "kvbroker_proxy_requests_waiting 0.0" in body
