"""Time for an engine session: injected, so tests move a clock instead of sleeping.

A session takes every liveness decision on one clock: when to heartbeat, how
long the broker has been silent (``SILENCE_TTLS``), whether this process
stalled (``STALL_S``), and how long to back off before reconnecting. The
clock both reads the time (``now``, seconds on a monotonic scale; only
differences mean anything) and waits (``sleep``), so a test that moves a
``ManualClock`` moves all of it, and nothing waits on the wall clock.

Deadlines on I/O (registration, resolve, lease calls) and the few
milliseconds of inventory batching stay on the event loop's own time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from typing import Protocol


class SessionClock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences mean anything."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once ``seconds`` have passed on this clock."""
        ...


class MonotonicClock:
    """The real one: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclasses.dataclass(eq=False)
class _Sleeper:
    wake_at: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


class ManualClock:
    """A clock that moves only when a test says so (``advance``).

    A ``sleep`` returns once ``advance`` has moved the clock to its wake-up
    time or past it. ``advance`` may be called from any thread, and sleepers
    may wait on any event loop (a ``ThreadedEngineSession``'s included).
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self._sleepers: list[_Sleeper] = []

    def now(self) -> float:
        with self._lock:
            return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        with self._lock:
            sleeper = _Sleeper(self._now + seconds, loop, loop.create_future())
            self._sleepers.append(sleeper)
        try:
            await sleeper.future
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._sleepers.remove(sleeper)

    def advance(self, seconds: float) -> None:
        """Move the clock forward and wake every sleeper whose time has come."""
        if seconds < 0:
            raise ValueError("a clock never goes back")
        with self._lock:
            self._now += seconds
            due = [s for s in self._sleepers if s.wake_at <= self._now]
            self._sleepers = [s for s in self._sleepers if s.wake_at > self._now]
        for sleeper in due:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
                sleeper.loop.call_soon_threadsafe(_wake, sleeper.future)

    def waiting(self) -> list[float]:
        """The wake-up times of the sleepers, earliest first."""
        with self._lock:
            return sorted(s.wake_at for s in self._sleepers)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
