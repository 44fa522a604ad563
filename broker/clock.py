"""Time for the domain core: injected, so tests advance a fake clock instead of sleeping.

All readings are seconds on a monotonic scale. Absolute wall-clock time never
decides an expiry (wire TTLs are relative durations).
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences mean anything."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock never goes back")
        self._now += seconds
