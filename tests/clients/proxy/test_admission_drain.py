"""Admission's backlog drain (clients/proxy/admission.py): past the pace limit only while
nothing running or waiting can meet its goal and none came for a first-token goal."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvbroker.clients.proxy.admission import AT_ONCE, DRAIN, LATE, Admission, Ticket
from tests.clients.proxy.admission_util import Clock, answers, settle

pytestmark = pytest.mark.timeout(30)


async def _backlog(clock: Clock) -> tuple[Admission, list[asyncio.Future[Any]]]:
    """Two engines held to one place each by a slow pace, both running, five waiting."""
    adm = Admission(4, ttft_goal_s=4.0, tpot_goal_s=0.1, clock=clock)
    adm.set_engines(2)
    answers(adm, 0.3, 12)
    assert adm.limit == 2
    assert [(await adm.enter()).order for _ in range(2)] == [AT_ONCE, AT_ONCE]
    waiting = [asyncio.ensure_future(adm.enter()) for _ in range(5)]
    await settle()
    return adm, waiting


async def test_a_hopeless_backlog_drains_past_the_pace_limit_once_requests_stop_coming() -> None:
    """Nothing running or waiting can meet its goal and none came for a first-token goal: the
    limit protects no one's pace, so the backlog runs at per_engine per engine, and the pace
    measured there does not move the limit."""
    clock = Clock()
    adm, waiting = await _backlog(clock)
    clock.now += 10.0  # every waiting request is past its first-token goal; none came since
    adm.leave(AT_ONCE)  # one in-time request still runs: its pace is kept
    await settle()
    assert [w.result().order for w in waiting if w.done()] == [LATE] and adm.running == 2
    adm.leave(AT_ONCE)  # none in time now: the place goes as before, the rest past the limit
    await settle()
    assert [w.result().order for w in waiting] == [LATE, LATE, DRAIN, DRAIN, DRAIN]
    assert adm.running == 5 and adm.waiting == 0 and adm.limit == 2
    pace = adm.pace_s
    answers(adm, 5.0, 4)  # while drained ones run: not the limit's pace
    assert adm.pace_s == pace and adm.limit == 2
    for _ in range(3):
        adm.leave(DRAIN)
    answers(adm, 5.0, 2)  # the drained ones ended: measured again
    assert adm.pace_s > pace


async def test_the_backlog_keeps_the_limit_while_requests_keep_coming() -> None:
    clock = Clock()
    adm, waiting = await _backlog(clock)
    adm.observed_ttft(5.0)  # dispatch to first token is over the goal: no one can meet it
    clock.now += 10.0
    waiting.append(asyncio.ensure_future(adm.enter()))  # came just now
    await settle()
    adm.leave(AT_ONCE)
    adm.leave(AT_ONCE)
    await settle()
    assert adm.running == 2 and adm.waiting == 4
    clock.now += 4.0  # none came for a first-token goal
    adm.leave(LATE)
    await settle()
    assert [w.result().order for w in waiting[2:]] == [LATE, DRAIN, DRAIN, DRAIN]
    assert adm.running == 5


async def test_the_backlog_keeps_the_limit_while_a_waiting_rest_can_keep_its_pace() -> None:
    clock = Clock()
    adm = Admission(2, ttft_goal_s=4.0, tpot_goal_s=0.3, clock=clock)
    adm.set_engines(1)
    answers(adm, 0.5, 1)  # over the goal: one place
    answers(adm, 0.1, 4)  # under it now (0.26 s a token), with no one waiting to add a place for
    assert adm.limit == 1
    await adm.enter()
    late = asyncio.ensure_future(adm.enter())
    await settle()
    clock.now += 10.0
    adm.leave(AT_ONCE)
    await settle()
    assert late.result().order == LATE  # it runs, and it is not in time
    ticket = Ticket()
    rest, other = asyncio.ensure_future(adm.enter(ticket)), asyncio.ensure_future(adm.enter())
    await settle()
    clock.now += 4.5  # both past the first-token goal, none came since
    adm.first_token_out(ticket, 100)  # its rest can keep the pace if it goes within 4 s
    adm.set_engines(1)  # (looks again, changing nothing else)
    await settle()
    assert not rest.done() and not other.done()
    clock.now += 5.0  # it can no longer
    adm.set_engines(1)
    await settle()
    assert rest.result().order == DRAIN and not other.done() and adm.running == 2
