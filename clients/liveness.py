"""When an engine's session stops waiting for its broker: the silence rules, apart from the stream.

``SessionStream`` (``kvbroker.clients.session_stream``) tells ``Liveness`` what
happens on the stream (a message heard, a heartbeat or request sent that the
broker answers, a stall of this very process) and asks it, at each wake-up of
the heartbeat loop, whether to give the stream up. Two rules:

- **One broker address**: give up only when nothing at all came back for
  ``SILENCE_TTLS`` session TTLs. The broker decides whether the session lives;
  a reconnect to it supersedes the session and ends its leases, so waiting
  out a broker that was only starved is the cheaper mistake (a dead broker
  breaks the stream long before).
- **Several replicas of a shared-state fleet**: a move keeps the session (the
  next replica resumes it from the store), so silence is acted on early: a
  heartbeat or request left unanswered for ``SILENT_TTL_FRACTION`` of the TTL
  moves the session on. A frozen replica, a paused host and a link that went
  dark without a reset all look like this; none of them breaks the stream.
  With heartbeats every third of the TTL, the move starts at most 7/12 of a
  TTL after the replica last heard the engine, leaving 5/12 of a TTL to
  register with the next replica before the session's deadline.

Time this process itself did not run (a timer firing ``STALL_S`` or more
late) is not counted as the broker's silence: the broker's answers may be
waiting unread in the socket. For the same reason, before a silent replica
is given up the read loop gets ``READ_PASSES`` passes of the event loop: a
move costs the session where the store is away (the next replica cannot
resume it), so an answer that a busy process has not read yet must count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# A timer firing later than this past its time means this process did not run.
STALL_S = 0.25
# Passes of the event loop the read loop gets before a silent replica is given up.
READ_PASSES = 5
# Give the stream up after this many session TTLs without a word from the broker.
SILENCE_TTLS = 3
# With several replicas: move on after a heartbeat or request went unanswered this part of the TTL.
SILENT_TTL_FRACTION = 0.25
# With several replicas: a registration gets at most half the TTL (at least this) before the next.
REGISTER_FLOOR_S = 1.0


def register_timeout_s(configured_s: float, ttl_s: float, several: bool) -> float:
    """How long to wait for a registration's answer: with several replicas, a frozen one must
    not hold the session past its TTL."""
    return min(configured_s, max(REGISTER_FLOOR_S, ttl_s / 2)) if several else configured_s


class GaveUp(Exception):
    """The broker answered nothing for SILENCE_TTLS session TTLs."""


class Silent(GaveUp):
    """A replica left a heartbeat or request unanswered for SILENT_TTL_FRACTION of the TTL."""


class Liveness:
    """What this side knows of the broker's liveness, on the session's clock (times in seconds)."""

    def __init__(self) -> None:
        self.last_heard = 0.0
        # When the oldest message still waiting for an answer was sent (None: nothing waits).
        self.unanswered_since: float | None = None

    def connected(self, now: float) -> None:
        """Just registered: heard now, nothing waits."""
        self.last_heard = now
        self.unanswered_since = None

    def heard(self, now: float) -> None:
        """A message came from the broker: it is alive, and it has read what came before."""
        self.last_heard = now
        self.unanswered_since = None

    def asked(self, now: float) -> None:
        """A message the broker answers (a heartbeat, a request) was sent."""
        if self.unanswered_since is None:
            self.unanswered_since = now

    def stalled(self, now: float, stalled_s: float) -> None:
        """This process did not run for ``stalled_s``: not the broker's silence."""
        self.last_heard = min(now, self.last_heard + stalled_s)
        self.unanswered_since = None

    def check(self, now: float, ttl_s: float, several: bool) -> None:
        """Raise ``Silent`` (several replicas) or ``GaveUp`` when the stream should be given up."""
        waiting = self.unanswered_since
        limit_s = ttl_s * SILENT_TTL_FRACTION
        if several and waiting is not None and now - waiting > limit_s:
            raise Silent(f"no answer for {now - waiting:.2f} s (limit {limit_s:g} s)")
        if now - self.last_heard > SILENCE_TTLS * ttl_s:
            raise GaveUp(
                f"broker answered nothing for {SILENCE_TTLS * ttl_s:g} s ({SILENCE_TTLS} session TTLs)"
            )

    async def check_after_reads(
        self, now: float, clock: Callable[[], float], ttl_s: float, several: bool
    ) -> None:
        """``check``, but a replica found silent is given up only after the read loop had
        READ_PASSES passes of the event loop to read an answer already in the socket."""
        try:
            self.check(now, ttl_s, several)
        except Silent:
            for _ in range(READ_PASSES):
                await asyncio.sleep(0)
            self.check(clock(), ttl_s, several)
