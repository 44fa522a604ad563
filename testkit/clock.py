"""One fake clock for every injected clock in kvbroker.

The product takes time three ways: the broker core reads ``clock.now()``
(``kvbroker.broker.clock.Clock``), an engine session also sleeps on it
(``kvbroker.clients.clock.SessionClock``), and the engine adapter's scheduler
side and block mover call ``clock()`` for seconds. ``FakeClock`` is all three:
``ManualClock`` (``now``, ``sleep``, ``advance``, ``waiting``) that can also be
called.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading


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


class FakeClock(ManualClock):
    """Stands still until a test calls ``advance(seconds)``; ``clock()`` is ``clock.now()``."""

    def __call__(self) -> float:
        return self.now()
