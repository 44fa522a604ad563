"""Time for the domain core: injected, so tests advance a fake clock instead of sleeping
(testkit.clock.FakeClock).

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


class WallClock:
    """Wall-clock seconds, for state shared through Redis: deadlines written by one broker
    process are read by others, so they need a scale every host agrees on (NTP-synced)."""

    def now(self) -> float:
        return time.time()
