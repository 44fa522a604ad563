"""Admission: at most N requests per engine run at once (N times the engines, in all: the
placement picks each one's engine); the rest wait at the proxy, and the one that can still
meet the time-to-first-token goal goes first.

Why. On a saturated fleet every request an engine takes slows the ones it already runs: its
prefill steps stall their decoding and their batch grows. First come, first served then lets
a burst push every request past its time-per-token goal and its first-token goal at once, and
goodput (requests meeting both) falls to a fraction of throughput. Held at the proxy, the
running requests keep their pace; of the waiting ones, a request that has already waited past
the first-token goal will be late whatever runs first, so one that can still make it goes
ahead of it.

When a place frees, the waiting request that goes is:

1. one that has waited ``max_wait_s``, the oldest such, at every other place (nothing waits
   forever, and a backlog longer than ``max_wait_s`` still leaves half the places to
   requests that can meet the goal: with all of them, every request would be late);
2. else the oldest that can still meet the goal: its wait so far plus the recent time from
   dispatch to first token (a moving average the proxy measures) is under ``ttft_goal_s``;
3. else the oldest (every waiting request will be late: first come, first served).

In 2, a request whose first token went out early (early_token.py, ``first_token_out``)
competes too: its time to first token is met, and what is left to meet is the pace of the
rest, so it can still meet the goal while the rest, at the measured pace, ends within its
answer's budget (``tpot_goal_s`` a token after that first one). Of all that can still meet
their goal, the one whose deadline comes first goes (earliest deadline first: a new
request's deadline is its arrival plus ``ttft_goal_s`` less the dispatch-to-first-token
time). Without this, a request given its first token early waited behind every newer one
that could still meet the first-token goal, up to ``max_wait_s``: measured at 2.5 req/s,
143 of 356 requests met the first-token goal and then missed the pace goal by waiting.

How many run at once: at most ``per_engine`` per engine. With a time-per-token goal
(``tpot_goal_s``) the limit follows the pace of the streamed answers the proxy relays, and
remembers the mean pace of the answers at each limit it ran (for 100 answers per engine:
the machine, or the prompts, may change). Each decision waits for as many answers as there
are engines at the limit now. Over the goal: one place fewer, if fewer may be faster (one
fewer was not measured lately, or some lower limit was measured at least 15% faster);
otherwise, while requests wait, one place more: fewer at once was no faster, so holding
requests back buys no pace and only serves fewer (at one per engine, where nothing lower is
left, likewise). Under the goal while requests wait: one place more if the pace (the mean
at this limit, or the moving average of the latest answers) is under 0.8 of the goal, or the
next limit up was measured under it. So a machine that slows down
runs fewer at once without a new setting, and one whose pace does not depend on how many
run (a small model on CPU: the engine step costs about the same for one answer or four, and
the prefills of arriving requests set the pace) is not held to one per engine. Measured
before this rule, at 2.5 req/s: the limit sat at one or two per engine for minutes with the
pace unchanged (0.18-0.27 s a token at every limit), and 100 requests waited.

The backlog drains: while nothing running or waiting can still meet its goal (every waiting
request past its first-token goal, no early one whose rest can still keep the pace, none
running that was let in while it could) and no request came for a whole ``ttft_goal_s``, the
oldest waiting go past the limit, up to ``per_engine`` per engine (order ``drain``). The limit
keeps a pace there that no request can use, and only makes the backlog, and the run, last
longer: at 2.5 req/s, 124-156 of 356 requests had waited 60 s or more, were served last under
the limit, and set the run's length. The pace of answers while drained requests run is not the
limit's and is not measured. A request that comes meanwhile waits for a place under the limit.

A request that waits past the point where it could meet ``ttft_goal_s`` may get its first
token early meanwhile (``late_in``; early_token.py, server.py): it still waits for a place here.
With ``ttft_goal_s`` 0 the order is first come, first served. ``per_engine`` 0 turns
admission off (every request goes at once, as before). Nothing is refused: a late request
is served late, never failed. Pure asyncio, no I/O: tests/clients/proxy/test_admission.py.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

IN_TIME = "in_time"  # it could still meet the goal when it went
REST_IN_TIME = "rest_in_time"  # its first token went out early; the rest could still meet the pace
LATE = "late"  # every waiting request was past the goal: the oldest went
OVERDUE = "overdue"  # it had waited max_wait_s
AT_ONCE = "at_once"  # a place was free when it came
FIRST_COME = "first_come"  # no goal set: the oldest went
DRAIN = "drain"  # past the pace limit: nothing running or waiting could meet its goal, none came lately
_IN_TIME_ORDERS = frozenset({AT_ONCE, IN_TIME, REST_IN_TIME})

_EWMA = 0.2  # weight of the newest figure in the moving averages (first-token time, pace)
_GAIN = 0.15  # a lower limit's pace must be this much faster to be worth going down to
_REMEASURE_AFTER = 100  # answers per engine after which a limit's measured pace is forgotten


@dataclass(eq=False)
class _Waiter:
    arrived: float
    future: asyncio.Future[str] = field(repr=False)
    queued: bool = True  # still in the queue (not let in, not gone)
    first_out: bool = False  # its first token went out early: its first-token deadline is past caring


class Ticket:
    """The caller's handle on its wait, for `Admission.first_token_out`."""

    __slots__ = ("waiter",)

    def __init__(self) -> None:
        self.waiter: _Waiter | None = None


@dataclass(frozen=True)
class Admitted:
    waited_s: float
    order: str  # AT_ONCE, IN_TIME, REST_IN_TIME, LATE, OVERDUE, DRAIN or FIRST_COME


class Admission:
    def __init__(
        self,
        per_engine: int,
        ttft_goal_s: float = 0.0,
        max_wait_s: float = 60.0,
        tpot_goal_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_engine < 0 or ttft_goal_s < 0 or tpot_goal_s < 0 or max_wait_s <= 0:
            raise ValueError("per_engine, ttft_goal_s and tpot_goal_s must be >= 0 and max_wait_s > 0")
        self.per_engine = per_engine
        self.ttft_goal_s = ttft_goal_s
        self.max_wait_s = max_wait_s
        self.tpot_goal_s = tpot_goal_s
        self._clock = clock
        self.running = 0
        self._engines = 1
        self._capacity = per_engine  # the limit now: per_engine * engines, less what the pace took
        self.pace_s = 0.0  # moving average of the answers' time per token; 0 until measured
        self._since_change = 0  # answers measured since the limit last changed
        self._answers = 0  # answers measured
        self._level_sum = 0.0  # their paces summed since the limit last changed
        self._paces: dict[int, tuple[float, int]] = {}  # limit -> (mean pace there, at answer)
        self._last_overdue = False  # the last place went to an overdue request
        self._waiting: list[_Waiter] = []  # in arrival order
        self._rest: list[tuple[float, int, _Waiter]] = []  # heap: (dispatch-by, seq, waiter); first_token_out
        self._seq = itertools.count()
        self.dispatch_ttft_s = 0.0  # moving average, dispatch to first token; 0 until measured
        self._in_time_running = 0  # running requests let in while they could meet their goal
        self._drained_running = 0  # running requests let in past the limit (DRAIN)
        self._last_arrival = -float("inf")

    @property
    def on(self) -> bool:
        return self.per_engine > 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def limit(self) -> int:
        return self._capacity

    def set_engines(self, engines: int) -> None:
        """The engines requests are served on now; the limit is at most `per_engine` per engine."""
        engines = max(engines, 1)
        if engines != self._engines or self.tpot_goal_s <= 0:
            # More engines, more places (as many per new engine as each has now); fewer, fewer.
            per = self._capacity / self._engines if self.tpot_goal_s > 0 else self.per_engine
            self._capacity = max(engines, min(self.per_engine * engines, round(per * engines)))
            self._engines = engines
            # A new level: the pace of answers measured at the old one is not its pace, and
            # the paces remembered per limit were measured with other engines.
            self._since_change, self._level_sum = 0, 0.0
            self._paces.clear()
        self._admit()

    def observed_tpot(self, seconds: float) -> None:
        """An answer's time per output token after the first: the pace the limit follows (not
        while the backlog drains past the limit: that is not the limit's pace)."""
        if seconds <= 0 or self.tpot_goal_s <= 0 or not self.on or self._drained_running:
            return
        old = self.pace_s
        self.pace_s = seconds if old == 0.0 else (1 - _EWMA) * old + _EWMA * seconds
        self._answers += 1
        self._since_change += 1
        self._level_sum += seconds
        if self._since_change < self._engines:
            return
        floor, top, cap = self._engines, self.per_engine * self._engines, self._capacity
        here = self._level_sum / self._since_change  # the mean pace of the answers at this limit
        if here > self.tpot_goal_s:
            if cap > floor and self._fewer_helps(here):
                self._change(-1)
            elif cap < top and self._waiting:
                # Fewer at once was measured no faster (or this is one per engine): holding
                # requests back buys no pace here, it only serves fewer and grows the queue.
                self._change(+1)
        elif cap < top and self._waiting:
            above = self._pace_at(cap + 1)
            # The moving average too: a mean over a long stay at one limit moves slowly.
            quick = min(here, self.pace_s) < 0.8 * self.tpot_goal_s
            if quick or (above is not None and above <= self.tpot_goal_s):
                self._change(+1)

    def _pace_at(self, level: int) -> float | None:
        """The mean pace measured the last time the limit was `level`, unless it is old (the
        machine, or the prompts, may have changed since)."""
        known = self._paces.get(level)
        if known is None or self._answers - known[1] > _REMEASURE_AFTER * self._engines:
            return None
        return known[0]

    def _fewer_helps(self, here: float) -> bool:
        """Whether a lower limit may bring the pace down: one less was not measured (lately),
        or some lower limit was measured at least _GAIN faster than `here`."""
        if self._pace_at(self._capacity - 1) is None:
            return True
        lower = (self._pace_at(level) for level in range(self._engines, self._capacity))
        return any(pace is not None and pace < (1 - _GAIN) * here for pace in lower)

    def _change(self, by: int) -> None:
        if self._since_change:
            self._paces[self._capacity] = (self._level_sum / self._since_change, self._answers)
        self._capacity += by
        self._since_change, self._level_sum = 0, 0.0
        if by > 0:
            self._admit()

    async def enter(self, ticket: Ticket | None = None) -> Admitted:
        """Wait for a place (at once when one is free and no one waits). The caller must
        `leave(admitted.order)`."""
        arrived = self._last_arrival = self._clock()
        if not self.on or (not self._waiting and self.running < self._capacity):
            self.running += 1
            self._in_time_running += 1
            return Admitted(0.0, AT_ONCE)
        waiter = _Waiter(arrived, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        if ticket is not None:
            ticket.waiter = waiter
        try:
            order = await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.leave(waiter.future.result())  # given a place just as its client went: freed again
            elif waiter.queued:
                waiter.queued = False
                self._waiting.remove(waiter)
            raise
        return Admitted(self._clock() - arrived, order)

    def first_token_out(self, ticket: Ticket, rest_tokens: int) -> None:
        """The waiting request's first token went out early, and up to `rest_tokens` are left:
        until the rest can no longer keep to `tpot_goal_s` a token (counted from now, at the
        measured pace), it goes before requests whose deadline comes later (module doc)."""
        waiter = ticket.waiter
        if waiter is None or not waiter.queued:
            return
        waiter.first_out = True
        if self.tpot_goal_s <= 0 or rest_tokens < 1:
            return
        pace = self.pace_s or self.tpot_goal_s  # unmeasured: no slack
        slack = rest_tokens * (self.tpot_goal_s - pace)
        if slack > 0:
            heapq.heappush(self._rest, (self._clock() + slack, next(self._seq), waiter))

    def leave(self, order: str = "") -> None:
        """A request let in with `order` (Admitted.order) has ended."""
        self.running = max(0, self.running - 1)
        if order in _IN_TIME_ORDERS:
            self._in_time_running = max(0, self._in_time_running - 1)
        elif order == DRAIN:
            self._drained_running = max(0, self._drained_running - 1)
        self._admit()

    def late_in(self) -> float | None:
        """Seconds from now until a request that starts waiting now can no longer meet the
        first-token goal (its wait plus the measured dispatch-to-first-token time); None
        without a goal, or with admission off."""
        if not self.on or self.ttft_goal_s <= 0:
            return None
        return max(0.0, self.ttft_goal_s - self.dispatch_ttft_s)

    def observed_ttft(self, seconds: float) -> None:
        """A request's time from dispatch to its first token, for who can still meet the goal."""
        if seconds < 0:
            return
        old = self.dispatch_ttft_s
        self.dispatch_ttft_s = seconds if old == 0.0 else (1 - _EWMA) * old + _EWMA * seconds

    def _admit(self) -> None:
        while self._waiting and self.running < self._capacity:
            index, order = self._pick(self._clock())
            waiter = self._waiting.pop(index)
            waiter.queued = False
            if waiter.future.done():  # cancelled: its client went away
                continue
            self.running += 1
            self._in_time_running += order in _IN_TIME_ORDERS
            waiter.future.set_result(order)
        self._drain()

    def _drain(self) -> None:
        """Past the pace limit, up to `per_engine` per engine, the oldest first: while nothing
        running or waiting can still meet its goal and no request came for a whole first-token
        goal (module doc). The limit keeps a pace no one can use then, and only makes the
        backlog, and the run, last longer."""
        if self.tpot_goal_s <= 0 or self.ttft_goal_s <= 0 or self._in_time_running:
            return
        now = self._clock()
        if now - self._last_arrival < self.ttft_goal_s or self._someone_in_time(now):
            return
        while self._waiting and self.running < self.per_engine * self._engines:
            waiter = self._waiting.pop(0)
            waiter.queued = False
            if not waiter.future.done():  # else cancelled: its client went away
                self.running += 1
                self._drained_running += 1
                waiter.future.set_result(DRAIN)

    def _someone_in_time(self, now: float) -> bool:
        """A waiting request can still meet its goal (as `_pick` judges, changing nothing)."""
        if self._first_in_time(now) < len(self._waiting):
            return True
        return any(w.queued and deadline >= now for deadline, _, w in self._rest)

    def _first_in_time(self, now: float) -> int:
        """The index of the oldest waiting request that can still meet the first-token goal (its
        first token not sent early); len(waiting) if none.

        In time: arrived after now + dispatch_ttft_s - ttft_goal_s. Waiters are in arrival order,
        so the oldest such is found by bisection (a long queue of late ones is not scanned)."""
        cutoff = now + self.dispatch_ttft_s - self.ttft_goal_s
        index = bisect.bisect_right(self._waiting, cutoff, key=lambda w: w.arrived)
        while index < len(self._waiting) and self._waiting[index].first_out:
            index += 1  # its deadline is the rest's (`_rest`), not its first token's
        return index

    def _pick(self, now: float) -> tuple[int, str]:
        overdue = now - self._waiting[0].arrived >= self.max_wait_s
        if overdue and not self._last_overdue:
            self._last_overdue = True
            return 0, OVERDUE
        self._last_overdue = False
        if self.ttft_goal_s <= 0:
            return 0, OVERDUE if overdue else FIRST_COME
        index = self._first_in_time(now)
        rest = self._rest
        while rest and (not rest[0][2].queued or rest[0][0] < now):
            heapq.heappop(rest)  # let in or gone already, or the rest can no longer keep the pace
        # Earliest deadline first; a new request's is its arrival plus the goal, less the measured
        # dispatch-to-first-token time.
        if rest and (
            index == len(self._waiting)
            or rest[0][0] < self._waiting[index].arrived + self.ttft_goal_s - self.dispatch_ttft_s
        ):
            return self._waiting.index(heapq.heappop(rest)[2]), REST_IN_TIME
        if index < len(self._waiting):
            return index, IN_TIME
        return 0, OVERDUE if overdue else LATE
