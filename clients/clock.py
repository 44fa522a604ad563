"""Time for an engine session: the clock it goes by, injected so tests move it instead of
sleeping, and the back-off it waits on that clock before trying the broker again.

A session takes every liveness decision on one clock: when to heartbeat, how
long the broker has been silent (``SILENCE_TTLS``), whether this process
stalled (``STALL_S``), and how long to back off before reconnecting. The
clock both reads the time (``now``, seconds on a monotonic scale; only
differences mean anything) and waits (``sleep``), so a test that moves a
fake one (``testkit.clock.ManualClock``) moves all of it, and nothing waits on
the wall clock.

Deadlines on I/O (registration, resolve, lease calls) and the few
milliseconds of inventory batching stay on the event loop's own time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable
from typing import Protocol


class SessionClock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences mean anything."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock."""
        ...


class AsyncioClock:
    """The real one: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Reconnect delays: exponential, capped, with random jitter.

    Attempt ``n`` (0-based) waits ``min(max_s, initial_s * multiplier**n)``
    shortened by up to ``jitter`` of itself at random, so that many engines
    that lost the same broker do not come back in lockstep.
    """

    initial_s: float = 0.1
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        base = min(self.max_s, self.initial_s * self.multiplier ** min(attempt, 64))
        return base * (1.0 - self.jitter * rand())
